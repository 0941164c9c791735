// Turns text files into a training data directory: train.bin and val.bin
// (uint16 token arrays) and tokenizer.txt.
//
//   prepare_data --output_dir=data/fortunes                    # Debian's fortunes, bytes
//   prepare_data --input=a.txt,b.txt --tokenizer=bpe --vocab_size=1024 --output_dir=data/mine
#include <gflags/gflags.h>

#include <cstdio>

#include "absl/strings/str_split.h"
#include "base/flags_help.h"
#include "base/status.h"
#include "data/data.h"

DEFINE_string(input, "", "comma-separated text files (default: Debian's fortunes)");
DEFINE_string(output_dir, "", "directory to write train.bin, val.bin and tokenizer.txt");
DEFINE_string(tokenizer, "byte", "byte (vocab 256) or bpe (trained on the input)");
DEFINE_int32(vocab_size, 512, "vocabulary size of the bpe tokenizer");
DEFINE_double(val_fraction, 0.1, "share of the tokens, from the end, held out for validation");

namespace trident {
namespace {

absl::Status Run() {
  if (FLAGS_output_dir.empty()) return absl::InvalidArgumentError("--output_dir is required");
  PrepareOptions options;
  if (!FLAGS_input.empty()) options.inputs = absl::StrSplit(FLAGS_input, ',', absl::SkipEmpty());
  options.output_dir = FLAGS_output_dir;
  options.tokenizer = FLAGS_tokenizer;
  options.vocab_size = FLAGS_vocab_size;
  options.val_fraction = FLAGS_val_fraction;
  TRIDENT_ASSIGN_OR_RETURN(PreparedData prepared, PrepareTextCorpus(options));
  std::printf("wrote %s (%lld tokens) and %s (%lld tokens), vocab %d, tokenizer %s\n", prepared.train_path.c_str(),
              static_cast<long long>(prepared.train_tokens), prepared.val_path.c_str(),
              static_cast<long long>(prepared.val_tokens), prepared.vocab_size, prepared.tokenizer_path.c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  gflags::SetUsageMessage("prepare_data --output_dir=DIR [--input=a.txt,b.txt] [--tokenizer=byte|bpe --vocab_size=N]");
  if (trident::HelpRequested(argc, argv)) return trident::PrintHelp(__FILE__);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return trident::ExitCodeFor("prepare_data", trident::Run());
}
