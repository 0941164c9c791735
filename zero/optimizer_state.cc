// The state of the element-wise optimizers (Adam, AdamW, SGD): its bytes, its
// serialisation, and each parameter's state by name.
#include <algorithm>
#include <cstring>
#include <sstream>

#include <torch/optim/adam.h>
#include <torch/optim/adamw.h>
#include <torch/optim/sgd.h>
#include <torch/serialize/archive.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"
#include "zero/zero.h"

namespace trident {
namespace {

int64_t Bytes(const at::Tensor& t) { return t.defined() ? t.numel() * static_cast<int64_t>(t.element_size()) : 0; }

// State tensors per element of the known element-wise optimizers (-1: unknown).
int StatePerElement(const torch::optim::Optimizer& optimizer) {
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) return 2;
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) return 2;
  if (auto* sgd = dynamic_cast<const torch::optim::SGD*>(&optimizer)) {
    const auto& options = static_cast<const torch::optim::SGDOptions&>(sgd->param_groups().front().options());
    return options.momentum() != 0 ? 1 : 0;
  }
  return -1;
}

template <typename State>
void AdamLikeState(const State& s, std::map<std::string, at::Tensor>& out) {
  out["step"] = at::scalar_tensor(static_cast<int64_t>(s.step()), at::kLong);
  out["exp_avg"] = s.exp_avg();
  out["exp_avg_sq"] = s.exp_avg_sq();
  if (s.max_exp_avg_sq().defined()) out["max_exp_avg_sq"] = s.max_exp_avg_sq();
}

template <typename State>
std::unique_ptr<State> MakeAdamLikeState(const std::map<std::string, at::Tensor>& in) {
  auto s = std::make_unique<State>();
  s->step(in.at("step").item<int64_t>());
  s->exp_avg(in.at("exp_avg"));
  s->exp_avg_sq(in.at("exp_avg_sq"));
  if (in.count("max_exp_avg_sq")) s->max_exp_avg_sq(in.at("max_exp_avg_sq"));
  return s;
}

}  // namespace

int64_t OptimizerStateBytes(const torch::optim::Optimizer& optimizer, int64_t parameter_bytes) {
  int64_t held = 0;
  for (const auto& item : optimizer.state()) {
    const torch::optim::OptimizerParamState* state = item.second.get();
    if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
      held += Bytes(adam->exp_avg()) + Bytes(adam->exp_avg_sq()) + Bytes(adam->max_exp_avg_sq());
    } else if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
      held += Bytes(adamw->exp_avg()) + Bytes(adamw->exp_avg_sq()) + Bytes(adamw->max_exp_avg_sq());
    } else if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
      held += Bytes(sgd->momentum_buffer());
    }
  }
  return held > 0 ? held : std::max(0, StatePerElement(optimizer)) * parameter_bytes;
}

NamedTensors SerializeOptimizer(const torch::optim::Optimizer& optimizer, const std::string& name) {
  torch::serialize::OutputArchive archive;
  optimizer.save(archive);
  std::ostringstream bytes;
  archive.save_to(bytes);
  const std::string data = bytes.str();
  at::Tensor blob = at::empty({static_cast<int64_t>(data.size())}, at::kByte);
  std::memcpy(blob.data_ptr(), data.data(), data.size());
  return {{name, blob}};
}

absl::Status DeserializeOptimizer(const NamedTensors& state, const std::string& name,
                                  torch::optim::Optimizer& optimizer) {
  auto found = std::find_if(state.begin(), state.end(), [&](const auto& item) { return item.first == name; });
  if (found == state.end()) {
    return absl::NotFoundError(absl::StrCat("the optimizer state ('", name,
                                            "') is missing: the checkpoint was saved with another "
                                            "zero_stage; resume with the zero_stage it was saved with"));
  }
  const at::Tensor& blob = found->second;
  return CatchExceptions("restoring the optimizer state", [&] {
    std::istringstream bytes(std::string(static_cast<const char*>(blob.data_ptr()), blob.numel()));
    torch::serialize::InputArchive archive;
    archive.load_from(bytes);
    optimizer.load(archive);
  });
}

absl::StatusOr<std::vector<std::string>> ElementwiseStateNames(const torch::optim::Optimizer& optimizer) {
  auto adam_like = [](bool amsgrad) {
    std::vector<std::string> names = {"exp_avg", "exp_avg_sq", "step"};
    if (amsgrad) names.push_back("max_exp_avg_sq");
    return names;
  };
  const auto& options = optimizer.param_groups().front().options();
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) {
    return adam_like(static_cast<const torch::optim::AdamWOptions&>(options).amsgrad());
  }
  if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) {
    return adam_like(static_cast<const torch::optim::AdamOptions&>(options).amsgrad());
  }
  if (StatePerElement(optimizer) == 1) return std::vector<std::string>{"momentum_buffer"};
  if (StatePerElement(optimizer) == 0) return std::vector<std::string>{};
  return absl::UnimplementedError("the optimizer's state is not known element by element (Adam, AdamW and SGD are)");
}

std::map<std::string, at::Tensor> ElementwiseState(const torch::optim::Optimizer& optimizer, const at::Tensor& param) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  std::map<std::string, at::Tensor> out;
  auto found = optimizer.state().find(OptimizerStateKey<Key>(param.unsafeGetTensorImpl()));
  if (found == optimizer.state().end()) return out;
  const torch::optim::OptimizerParamState* state = found->second.get();
  if (auto* adamw = dynamic_cast<const torch::optim::AdamWParamState*>(state)) {
    AdamLikeState(*adamw, out);
  } else if (auto* adam = dynamic_cast<const torch::optim::AdamParamState*>(state)) {
    AdamLikeState(*adam, out);
  } else if (auto* sgd = dynamic_cast<const torch::optim::SGDParamState*>(state)) {
    if (sgd->momentum_buffer().defined()) out["momentum_buffer"] = sgd->momentum_buffer();
  }
  return out;
}

absl::Status SetElementwiseState(torch::optim::Optimizer& optimizer, const at::Tensor& param,
                                 const std::map<std::string, at::Tensor>& state) {
  using Key = typename std::decay_t<decltype(optimizer.state())>::key_type;
  const Key key = OptimizerStateKey<Key>(param.unsafeGetTensorImpl());
  if (state.empty()) {
    optimizer.state().erase(key);
    return absl::OkStatus();
  }
  if (dynamic_cast<const torch::optim::AdamW*>(&optimizer) != nullptr) {
    optimizer.state()[key] = MakeAdamLikeState<torch::optim::AdamWParamState>(state);
  } else if (dynamic_cast<const torch::optim::Adam*>(&optimizer) != nullptr) {
    optimizer.state()[key] = MakeAdamLikeState<torch::optim::AdamParamState>(state);
  } else if (StatePerElement(optimizer) >= 0) {
    auto sgd = std::make_unique<torch::optim::SGDParamState>();
    if (state.count("momentum_buffer")) sgd->momentum_buffer(state.at("momentum_buffer"));
    optimizer.state()[key] = std::move(sgd);
  } else {
    return absl::UnimplementedError("the optimizer's state is not known element by element");
  }
  return absl::OkStatus();
}

}  // namespace trident
