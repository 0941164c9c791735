// Traces a model of the zoo, or a TorchScript file saved from Python, and
// prints its operator graph: one row per node (kind, output shape, FLOPs,
// parameter and activation bytes, parameters read) and the totals.
//
//   graph_dump gpt [--preset=gpt2-124m] [--batch=1] [--seq=128] [--ir]
//   graph_dump torchscript:model.pt --seq=16 --vocab=256 [--ir]   (every input: token ids)
#include <gflags/gflags.h>

#include <cstdio>

#include <torch/torch.h>

#include "absl/strings/str_cat.h"
#include "base/flags_help.h"
#include "base/status.h"
#include "graph/graph.h"
#include "models/models.h"

DEFINE_string(preset, "", "size preset (default: the model's smallest)");
DEFINE_int32(batch, 1, "example batch size");
DEFINE_int32(seq, 0, "example sequence length (0: the model's block_size)");
DEFINE_bool(ir, false, "also print the TorchScript IR");
DEFINE_int32(vocab, 256, "TorchScript models: token ids of the example inputs are below this");

namespace trident {
namespace {

constexpr char kTorchScript[] = "torchscript:";

absl::Status Print(const std::string& title, const ModelGraph& graph) {
  std::printf("%s\n%s", title.c_str(), graph.Summary().c_str());
  if (FLAGS_ir) std::printf("%s\n", graph.IrText().c_str());
  return absl::OkStatus();
}

absl::Status RunTorchScript(const std::string& path) {
  if (FLAGS_seq <= 0) return absl::InvalidArgumentError("a TorchScript model needs --seq (its example length)");
  TRIDENT_ASSIGN_OR_RETURN(TorchScriptModule module, TorchScriptModule::Load(path));
  std::vector<at::Tensor> inputs;
  for (size_t i = 0; i < module.argument_names.size(); ++i) {
    inputs.push_back(torch::randint(FLAGS_vocab, {FLAGS_batch, FLAGS_seq}, torch::kLong));
  }
  TRIDENT_ASSIGN_OR_RETURN(auto graph, ModelGraph::FromTorchScript(path, inputs));
  return Print(absl::StrCat(path, ", ", inputs.size(), " input(s) [", FLAGS_batch, ", ", FLAGS_seq, "]"), *graph);
}

absl::Status Run(const std::string& model_name) {
  if (model_name.rfind(kTorchScript, 0) == 0) return RunTorchScript(model_name.substr(sizeof(kTorchScript) - 1));
  std::string preset = FLAGS_preset;
  if (preset.empty()) {
    auto names = PresetNames(model_name);
    if (names.empty()) return PresetModelConfig(model_name, "").status();  // names the known models
    preset = names.front();
  }
  TRIDENT_ASSIGN_OR_RETURN(ModelConfig config, PresetModelConfig(model_name, preset));
  TRIDENT_ASSIGN_OR_RETURN(auto model, CreateModel(config, 1));
  const int64_t seq = FLAGS_seq > 0 ? FLAGS_seq : config.block_size;
  auto tokens = torch::randint(config.vocab_size, {FLAGS_batch, seq}, torch::kLong);
  auto targets = torch::randint(config.vocab_size, {FLAGS_batch, seq}, torch::kLong);
  TRIDENT_ASSIGN_OR_RETURN(auto graph,
                           ModelGraph::Trace(*model, {tokens, targets}, [&](const std::vector<at::Tensor>& in) {
                             return std::vector<at::Tensor>{model->Loss(in[0], in[1])};
                           }));
  return Print(absl::StrCat(model_name, " ", preset, ", input [", FLAGS_batch, ", ", seq, "]"), *graph);
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  gflags::SetUsageMessage("graph_dump MODEL|torchscript:PATH [--preset=NAME] [--batch=N] [--seq=T] [--vocab=V] [--ir]");
  if (trident::HelpRequested(argc, argv)) return trident::PrintHelp(__FILE__);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  if (argc != 2) {
    return trident::ExitCodeFor("graph_dump",
                                absl::InvalidArgumentError("name one model: gpt, llama, mlp or torchscript:PATH"));
  }
  return trident::ExitCodeFor("graph_dump", trident::Run(argv[1]));
}
