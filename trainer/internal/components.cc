#include "trainer/internal/components.h"

#include <cstdio>
#include <cstdlib>
#include <filesystem>

#include <unistd.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "trainer/config.h"

namespace trident {
namespace internal {
namespace {

namespace fs = std::filesystem;

absl::StatusOr<std::unique_ptr<Dataset>> Open(const std::string& type, const std::string& role,
                                              const google::protobuf::Map<std::string, std::string>& args) {
  return MakeDataset(type,
                     ComponentArgs(absl::StrCat("dataset '", type, "' (", role, ")"), {args.begin(), args.end()}));
}

}  // namespace

std::string DataDirectory(const TrainerConfig& config) {
  if (!config.dataset().dir().empty()) return config.dataset().dir();
  const char* home = std::getenv("HOME");
  return absl::StrCat(home != nullptr ? home : "/tmp", "/.cache/trident/data/fortunes-byte");
}

absl::StatusOr<TrainingParts> BuildParts(const TrainerConfig& config, const ModelContext& given, bool open_data) {
  TrainingParts parts;
  ModelContext context = given;
  const bool token_data = config.dataset().type().empty();
  const std::string dir = DataDirectory(config);
  if (token_data) {
    const bool prepared_later = config.dataset().dir().empty() && !open_data;  // the default corpus
    if (!prepared_later && !fs::exists(dir + "/train.bin")) {
      return absl::NotFoundError(
          absl::StrCat("data directory ", dir, " has no train.bin; prepare it with tools/prepare_data"));
    }
    if (fs::exists(dir + "/tokenizer.txt")) {
      TRIDENT_ASSIGN_OR_RETURN(parts.tokenizer, LoadTokenizer(dir + "/tokenizer.txt"));
    } else {
      parts.tokenizer = MakeByteTokenizer();
    }
    context.data_vocab_size = parts.tokenizer->vocab_size();
  }
  auto [type, args] = ModelComponent(config);
  TRIDENT_ASSIGN_OR_RETURN(ModelFactory factory, ModelRegistry().Find(type));
  TRIDENT_ASSIGN_OR_RETURN(parts.model, factory(args, context));
  if (!config.model().loss().empty()) {
    TRIDENT_ASSIGN_OR_RETURN(parts.model.loss, LossRegistry().Find(config.model().loss()));
  }
  auto [optimizer, optimizer_args] = OptimizerComponent(config);
  TRIDENT_ASSIGN_OR_RETURN(parts.optimizer, MakeOptimizerFactory(optimizer, optimizer_args));
  if (!token_data) {
    const auto& d = config.dataset();
    if (!open_data) return parts;
    TRIDENT_ASSIGN_OR_RETURN(parts.train_data, Open(d.type(), "train", d.train_args()));
    if (!d.val_args().empty()) {
      TRIDENT_ASSIGN_OR_RETURN(parts.val_data, Open(d.type(), "val", d.val_args()));
    }
    return parts;
  }
  if (parts.model.sequence_length < 1) {
    return absl::InvalidArgumentError(
        absl::StrCat("model '", type,
                     "' trains on the token data but does not say how long a sample is: set "
                     "block_size (and vocab_size) to describe the data"));
  }
  if (!open_data) return parts;
  google::protobuf::Map<std::string, std::string> data_args;
  data_args["path"] = dir + "/train.bin";
  data_args["block_size"] = absl::StrCat(parts.model.sequence_length);
  data_args["vocab_size"] = absl::StrCat(parts.model.vocab_size > 0 ? parts.model.vocab_size : context.data_vocab_size);
  TRIDENT_ASSIGN_OR_RETURN(parts.train_data, Open("tokens", "train", data_args));
  if (fs::exists(dir + "/val.bin")) {
    data_args["path"] = dir + "/val.bin";
    TRIDENT_ASSIGN_OR_RETURN(parts.val_data, Open("tokens", "val", data_args));
  }
  return parts;
}

absl::Status PrepareDefaultCorpus(const TrainerConfig& config, const Topology& topology) {
  if (!config.dataset().dir().empty() || !config.dataset().type().empty()) return absl::OkStatus();
  const std::string dir = internal::DataDirectory(config);
  if (topology.rank() == 0 && !fs::exists(dir + "/train.bin")) {
    std::printf("preparing the default corpus (Debian's fortunes, byte tokens) in %s\n", dir.c_str());
    // Written aside and renamed, so a concurrent run never reads half a file.
    PrepareOptions options;
    options.output_dir = absl::StrCat(dir, ".tmp-", getpid());
    TRIDENT_RETURN_IF_ERROR(PrepareTextCorpus(options).status());
    std::error_code error;
    fs::rename(options.output_dir, dir, error);
    if (error) fs::remove_all(options.output_dir, error);  // another run got there first
  }
  return topology.world().Barrier();
}

}  // namespace internal
}  // namespace trident
