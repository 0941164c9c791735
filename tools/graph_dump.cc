// Traces a model of the zoo and prints its operator graph: one row per node
// (kind, output shape, FLOPs, parameter and activation bytes, parameters read)
// and the totals.
//
//   graph_dump gpt [--preset=gpt2-124m] [--batch=1] [--seq=128] [--ir]
#include <gflags/gflags.h>

#include <cstdio>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "graph/graph.h"
#include "models/models.h"

DEFINE_string(preset, "", "size preset (default: the model's smallest)");
DEFINE_int32(batch, 1, "example batch size");
DEFINE_int32(seq, 0, "example sequence length (0: the model's block_size)");
DEFINE_bool(ir, false, "also print the TorchScript IR");

namespace trident {
namespace {

absl::Status Run(const std::string& model_name) {
  std::string preset = FLAGS_preset;
  if (preset.empty()) {
    auto names = PresetNames(model_name);
    if (names.empty()) {
      return absl::InvalidArgumentError(
          absl::StrCat("unknown model '", model_name, "'; choose gpt, llama or mlp"));
    }
    preset = names.front();
  }
  TRIDENT_ASSIGN_OR_RETURN(ModelConfig config, PresetModelConfig(model_name, preset));
  TRIDENT_ASSIGN_OR_RETURN(auto model, CreateModel(config, 1));
  const int64_t seq = FLAGS_seq > 0 ? FLAGS_seq : config.block_size;
  auto tokens = torch::randint(config.vocab_size, {FLAGS_batch, seq}, torch::kLong);
  auto targets = torch::randint(config.vocab_size, {FLAGS_batch, seq}, torch::kLong);
  TRIDENT_ASSIGN_OR_RETURN(
      auto graph, ModelGraph::Trace(*model, {tokens, targets}, [&](const std::vector<at::Tensor>& in) {
        return std::vector<at::Tensor>{model->Loss(in[0], in[1])};
      }));
  std::printf("%s %s, input [%d, %lld]\n%s", model_name.c_str(), preset.c_str(), FLAGS_batch,
              static_cast<long long>(seq), graph->Summary().c_str());
  if (FLAGS_ir) std::printf("%s\n", graph->IrText().c_str());
  return absl::OkStatus();
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  gflags::SetUsageMessage("graph_dump MODEL [--preset=NAME] [--batch=N] [--seq=T] [--ir]");
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (argc != 2) {
    return trident::ExitCodeFor("graph_dump",
                                absl::InvalidArgumentError("name one model: gpt, llama or mlp"));
  }
  return trident::ExitCodeFor("graph_dump", trident::Run(argv[1]));
}
