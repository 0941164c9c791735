#include "base/recompute.h"

#include <mutex>
#include <unordered_set>

#include <ATen/autocast_mode.h>
#include <ATen/core/ivalue.h>
#include <c10/core/GradMode.h>
#include <torch/csrc/autograd/autograd.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/functions/accumulate_grad.h>

#include "base/autocast_state.h"
#include "base/rng.h"

namespace trident {
namespace {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

struct AutocastStates {
  AutocastState cpu, cuda;
  bool cache = true;
};

AutocastStates CurrentAutocast() {
  return {GetAutocastState(c10::DeviceType::CPU), GetAutocastState(c10::DeviceType::CUDA),
          at::autocast::is_autocast_cache_enabled()};
}

void SetAutocast(const AutocastStates& states) {
  SetAutocastState(c10::DeviceType::CPU, states.cpu);
  SetAutocastState(c10::DeviceType::CUDA, states.cuda);
  at::autocast::set_autocast_cache_enabled(states.cache);
}

// Runs its scope with `autocast` and, when given, `rng`; restores the
// thread's own afterwards. `cached`: the scope's casts of weights are shared
// among its own reads, as a plain forward's are (autocast's cache, emptied
// on entry and on exit so that no cast comes in from outside or stays
// behind); otherwise the cache is neither read nor written.
class RunLike {
 public:
  RunLike(const AutocastStates& autocast, const RngStates* rng, bool cached)
      : autocast_(CurrentAutocast()),
        rng_(rng != nullptr ? GetRngStates(rng->cuda_device) : RngStates()),
        cached_(cached && autocast.cache) {
    AutocastStates scoped = autocast;
    scoped.cache = cached_;
    SetAutocast(scoped);
    if (cached_) at::autocast::clear_cache();
    if (rng != nullptr) SetRngStates(*rng);
  }
  ~RunLike() {
    if (cached_) at::autocast::clear_cache();
    SetAutocast(autocast_);
    if (rng_.cpu.defined()) SetRngStates(rng_);
  }
  RunLike(const RunLike&) = delete;
  RunLike& operator=(const RunLike&) = delete;

 private:
  AutocastStates autocast_;
  RngStates rng_;
  bool cached_;
};

// The GPU whose generator the forward may draw from: that of its first CUDA tensor.
int CudaDeviceOf(at::TensorList tensors) {
  for (const at::Tensor& t : tensors) {
    if (t.defined() && t.is_cuda()) return t.get_device();
  }
  return -1;
}

// Every leaf the rerun's graph accumulates into must be one whose gradient
// leaves through the node: any other would silently get none.
void CheckEveryLeafIsListed(const Values& roots, const Values& listed) {
  std::unordered_set<const c10::TensorImpl*> known;
  for (const at::Tensor& t : listed) known.insert(t.unsafeGetTensorImpl());
  std::vector<torch::autograd::Node*> stack;
  std::unordered_set<torch::autograd::Node*> seen;
  for (const at::Tensor& root : roots) {
    torch::autograd::Node* node = torch::autograd::impl::gradient_edge(root).function.get();
    if (node != nullptr && seen.insert(node).second) stack.push_back(node);
  }
  while (!stack.empty()) {
    torch::autograd::Node* node = stack.back();
    stack.pop_back();
    if (auto* accumulate = dynamic_cast<torch::autograd::AccumulateGrad*>(node)) {
      const at::Tensor& leaf = accumulate->variable;
      TORCH_CHECK(known.count(leaf.unsafeGetTensorImpl()) > 0,
                  "RecomputeInBackward: the recomputed forward reads a tensor of shape ", leaf.sizes(),
                  " that needs a gradient but is neither among its inputs nor among its parameters; "
                  "list it in `parameters` (a module's parameters())");
      continue;
    }
    for (const torch::autograd::Edge& edge : node->next_edges()) {
      if (edge.is_valid() && seen.insert(edge.function.get()).second) stack.push_back(edge.function.get());
    }
  }
}

class Recomputation : public torch::CustomClassHolder {
 public:
  std::function<Values(const Values&)> forward;
  size_t num_inputs = 0;
  Values inputs;  // until the rerun
  std::vector<int64_t> versions;
  Values parameters;
  RngStates rng;
  AutocastStates autocast;
  std::mutex mutex;  // Ahead (the caller's thread) against backward (maybe another)

  // Reruns the forward with gradients, once.
  void Rerun() {
    if (rerun_) return;
    for (size_t k = 0; k < inputs.size(); ++k) {
      TORCH_CHECK(!inputs[k].defined() || inputs[k]._version() == versions[k], "RecomputeInBackward: input ", k,
                  " (shape ", inputs[k].sizes(), ") was modified in place after the forward that recomputes it");
      leaves_.push_back(inputs[k].defined() ? inputs[k].detach().requires_grad_(inputs[k].requires_grad()) : inputs[k]);
    }
    inputs.clear();
    {
      RunLike run(autocast, &rng, /*cached=*/true);
      c10::AutoGradMode with_grad(true);
      // NOTE: the forward reads views of the new leaves, which it sees as the
      // activations they were: autocast caches the casts of leaves that need
      // gradients, so an input read by two products (q, k and v projections)
      // would share one cast and sum its gradients in the lower precision.
      Values seen;
      for (const at::Tensor& leaf : leaves_)
        seen.push_back(leaf.defined() && leaf.requires_grad() ? leaf.view_as(leaf) : leaf);
      outputs_ = forward(seen);
    }
    rerun_ = true;
  }

  // The gradients of every input and parameter that needs one, from the
  // rerun; the rerun's graph is freed.
  void ComputeGradients(const variable_list& output_grads) {
    Rerun();
    Values roots, with;
    for (size_t k = 0; k < outputs_.size() && k < output_grads.size(); ++k) {
      if (!outputs_[k].defined() || !outputs_[k].requires_grad() || !output_grads[k].defined()) continue;
      roots.push_back(outputs_[k]);
      with.push_back(output_grads[k]);
    }
    Values tensors = leaves_;
    tensors.insert(tensors.end(), parameters.begin(), parameters.end());
    Values wanted;
    std::vector<size_t> position;
    for (size_t i = 0; i < tensors.size(); ++i) {
      if (!tensors[i].defined() || !tensors[i].requires_grad()) continue;
      wanted.push_back(tensors[i]);
      position.push_back(i);
    }
    grads_.assign(tensors.size(), at::Tensor());
    if (!roots.empty() && !wanted.empty()) {
      CheckEveryLeafIsListed(roots, wanted);
      variable_list got = torch::autograd::grad(roots, wanted, with, /*retain_graph=*/false,
                                                /*create_graph=*/false, /*allow_unused=*/true);
      for (size_t j = 0; j < got.size(); ++j) grads_[position[j]] = std::move(got[j]);
    }
    leaves_.clear();
    outputs_.clear();
    computed_ = true;
  }

  bool computed() const { return computed_; }
  // Hands out the gradient of tensor input i, once.
  at::Tensor TakeGradient(size_t i) {
    TORCH_CHECK(!taken_.count(i),
                "RecomputeInBackward: backward asked twice for the gradients of one recomputed "
                "forward (a second backward through the same graph); run the forward again");
    taken_.insert(i);
    return std::move(grads_[i]);
  }

 private:
  bool rerun_ = false, computed_ = false;
  Values leaves_, outputs_;  // the rerun: its inputs as new leaves, and its outputs
  variable_list grads_;      // per tensor input, until taken
  std::unordered_set<size_t> taken_;
};

class RecomputeFunction : public torch::autograd::Function<RecomputeFunction> {
 public:
  // `tensors`: the forward's inputs, then the parameters (a TensorList: autograd sees each tensor).
  static variable_list forward(AutogradContext* ctx, c10::intrusive_ptr<Recomputation> r, at::TensorList tensors) {
    ctx->set_materialize_grads(false);
    r->rng = GetRngStates(CudaDeviceOf(tensors));
    r->autocast = CurrentAutocast();
    r->inputs.assign(tensors.begin(), tensors.begin() + r->num_inputs);
    for (const at::Tensor& t : r->inputs) r->versions.push_back(t.defined() ? t._version() : 0);
    Values outputs;
    {
      RunLike run(r->autocast, nullptr, /*cached=*/false);
      outputs = r->forward(r->inputs);  // gradients are off in here
    }
    ctx->saved_data["recomputation"] = c10::IValue::make_capsule(std::move(r));
    return outputs;
  }

  static variable_list backward(AutogradContext* ctx, variable_list output_grads) {
    auto r = c10::static_intrusive_pointer_cast<Recomputation>(ctx->saved_data["recomputation"].toCapsule());
    std::lock_guard<std::mutex> lock(r->mutex);
    const size_t n = r->num_inputs + r->parameters.size();
    variable_list grads(1 + n);  // [0]: the Recomputation, not a tensor
    if (!r->computed()) {
      bool asked = false;
      for (size_t i = 0; i < n; ++i) asked |= ctx->needs_input_grad(i);
      if (!asked) return grads;  // a split backward's input part with no input to reach: the rerun waits
      r->ComputeGradients(output_grads);
    }
    for (size_t i = 0; i < n; ++i) {
      if (ctx->needs_input_grad(i)) grads[1 + i] = r->TakeGradient(i);
    }
    return grads;
  }
};

}  // namespace

Values RecomputeInBackward(const std::function<Values(const Values&)>& forward, const Values& inputs,
                           const Values& parameters, std::function<void()>* ahead) {
  if (!c10::GradMode::is_enabled()) return forward(inputs);
  auto r = c10::make_intrusive<Recomputation>();
  r->forward = forward;
  r->num_inputs = inputs.size();
  // Each parameter once (a layer range may list a tied one twice): each edge
  // to it carries its whole gradient.
  std::unordered_set<const c10::TensorImpl*> listed;
  for (const at::Tensor& t : inputs) {
    if (t.defined()) listed.insert(t.unsafeGetTensorImpl());
  }
  for (const at::Tensor& p : parameters) {
    if (p.defined() && listed.insert(p.unsafeGetTensorImpl()).second) r->parameters.push_back(p);
  }
  if (ahead != nullptr) {
    *ahead = [weak = c10::weak_intrusive_ptr<Recomputation>(r)] {
      c10::intrusive_ptr<Recomputation> held = weak.lock();
      if (!held) return;
      std::lock_guard<std::mutex> lock(held->mutex);
      if (!held->computed()) held->Rerun();
    };
  }
  Values tensors = inputs;
  tensors.insert(tensors.end(), r->parameters.begin(), r->parameters.end());
  return RecomputeFunction::apply(r, at::TensorList(tensors));
}

}  // namespace trident
