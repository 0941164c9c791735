// lora: LoRA fine-tuning (low-rank adapters, as PEFT's LoraConfig describes
// them) on any model whose linear layers are ColumnParallelLinear,
// RowParallelLinear or ParallelLinear (the zoo's are), in any layout.
//
// Every target layer gains A [r, in] (Kaiming-uniform, drawn from the seed and
// A's name, so every layout starts from the same values) and B [out, r]
// (zeros) with scale alpha / r: y = x W^T + b + scale * dropout(x) A^T B^T.
// Every other parameter is frozen (requires_grad false: no gradient, no
// optimizer state, no reduction) except the biases `bias` names and the
// modules in modules_to_save. Parallelize applies it (ParallelPlan::lora);
// under tensor parallelism the adapters split as the layer does (see
// LowRankAdapter).
//
//   LoraConfig lora;  // lora/lora_config.proto
//   lora.set_r(8);
//   lora.set_alpha(16);
//   lora.add_target_modules("c_attn");
//   lora.add_target_modules("c_proj");
//   TRIDENT_ASSIGN_OR_RETURN(LoraLayers adapted, ApplyLora(*model, lora, /*seed=*/1));
//
// Adapter parameters are named "<module>.lora_A.<adapter>.weight" and
// "<module>.lora_B.<adapter>.weight"; PeftAdapter exports them under PEFT's
// names and MergeAdapters folds them into the base weights.
#ifndef TRIDENT_LORA_LORA_H_
#define TRIDENT_LORA_LORA_H_

#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "base/tensors.h"
#include "lora/lora_config.pb.h"
#include "tensor_parallel/tensor_parallel.h"

namespace torch::nn {
class Module;
}  // namespace torch::nn

namespace trident {

class ModelGraph;  // graph/model_graph.h

// LoRA's scale: alpha / r.
double LoraScale(const LoraConfig& lora);

// Errors naming the field for values that cannot work.
absl::Status ValidateLoraConfig(const LoraConfig& options);
// Reads a LoraConfig text file (lora/lora_config.proto); errors name the file
// and what is wrong in it.
absl::StatusOr<LoraConfig> ReadLoraConfig(const std::string& path, const std::string& adapter_name);

// What ApplyLora did to a model (or to one pipeline stage of it).
struct LoraLayers {
  std::vector<std::string> adapted;  // the modules that got adapters, by name
  // Adapter parameters split over the tensor-parallel group, by full name.
  std::map<std::string, ShardSpec> shards;
  // How many modules each target_modules entry matched (in order): a pattern
  // that matches nothing on any pipeline stage is a mistake.
  std::vector<int> target_hits;
  int64_t trainable_parameters = 0;  // elements of the parameters left trainable here
};

// Adds the adapters to `model` (built whole, or one stage of it, possibly
// sharded for tensor parallelism) and freezes the rest. Errors name a target
// that is not a linear layer of a kind that takes an adapter.
absl::StatusOr<LoraLayers> ApplyLora(torch::nn::Module& model, const LoraConfig& options, uint64_t seed);

// A traced model with adapters: every linear product (aten::linear) whose
// weight is a parameter "<layer>.weight" of a target layer gains the
// low-rank path, its A and B appended to the parameters under the names
// ApplyLora gives them (and drawn the same way). Parameters are frozen as
// ApplyLora freezes them. Trace `forward` (ModelGraph::Trace) with
// `parameters` for the adapted model's graph. `shards`: how the graph's
// parameters are this rank's slices (a graph AutoTensorParallel rewrote):
// adapters are sliced and their products enter and leave the tensor-parallel
// regions as ApplyLora's do (layers.shards gets the adapters' slices).
// Errors: adapter dropout (not offered on traced models), a split product
// whose region does not begin or end right at it.
struct LoraGraph {
  NamedTensors parameters;
  std::function<std::vector<at::Tensor>(const std::vector<at::Tensor>&)> forward;
  LoraLayers layers;
};
absl::StatusOr<LoraGraph> ApplyLoraToGraph(const ModelGraph& graph, const LoraConfig& options, uint64_t seed,
                                           const std::map<std::string, ShardSpec>& shards = {});

// Whether `name` is an adapter parameter ("...lora_A.<adapter>.weight").
bool IsAdapterParameter(const std::string& name);

// The adapter tensors of `full` (the single-process model's tensors) under
// PEFT's names: "base_model.model.<module>.lora_A.<adapter>.weight", plus
// the modules_to_save's tensors as "base_model.model.<name>".
NamedTensors PeftAdapter(const NamedTensors& full, const LoraConfig& options);
// `full` with every adapter folded into its layer (W + scale * B A) and the
// adapter tensors left out: the base model, fine-tuned. Errors name an
// adapter whose layer's weight is missing.
absl::StatusOr<NamedTensors> MergeAdapters(const NamedTensors& full, const LoraConfig& options);

}  // namespace trident

#endif  // TRIDENT_LORA_LORA_H_
