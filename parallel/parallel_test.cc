// ParallelModel behaviours below the trainer: gradient and loss reductions,
// the three ways a module runs (traced, eager, as layers), missing topology
// axes, and the errors Parallelize gives on every rank before any step.
#include "parallel/parallel.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/memory_counter.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

// A small MLP with a skip connection, returning its prediction.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(4, 8));
    b = register_module("b", torch::nn::Linear(8, 8));
    c = register_module("c", torch::nn::Linear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::tanh(a(x));
    return c(torch::tanh(b(h)) + h);
  }
  torch::nn::Linear a{nullptr}, b{nullptr}, c{nullptr};
};
TORCH_MODULE(TinyNet);

// The same network declared as two layers (for trace_method=layers).
class TinyLayers : public TinyNetImpl, public LayerSequence {
 public:
  int64_t NumLayers() const override { return 2; }
  std::string LayerName(int64_t i) const override { return i == 0 ? "a" : "bc"; }
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override {
    if (i == 0) return {torch::tanh(a(batch.at(0)))};
    return {c(torch::tanh(b(inputs.at(0))) + inputs.at(0))};
  }
  NamedTensors LayerParameters(int64_t i) override {
    NamedTensors out;
    for (const auto& item : named_parameters()) {
      if ((i == 0) == (item.key()[0] == 'a')) out.emplace_back(item.key(), item.value());
    }
    return out;
  }
};

ModelSource TinySource(const LossFunction& loss = nullptr) {
  auto net = std::make_shared<TinyNetImpl>();
  ModelSource source = ModelSource::FromModule(net, [net](const Values& in) { return Values{net->forward(in[0])}; });
  source.loss = loss ? loss : *LossRegistry().Find("mse");
  return source;
}

// Micro-batch m: inputs [2, 4] and targets [2, 1], the same on every rank.
Batch MicroBatch(int m) {
  torch::manual_seed(100 + m);
  return {torch::randn({2, 4}), torch::randn({2, 1})};
}

OptimizerFactory Sgd() { return *MakeOptimizerFactory("sgd", ComponentArgs()); }

// Gradients after one ForwardBackward of `plan` on `source`, by name, and the loss.
std::map<std::string, at::Tensor> Gradients(ParallelModel& model, const std::vector<Batch>& batches, double* loss) {
  model.ZeroGrad();
  auto result = model.ForwardBackward(batches);
  EXPECT_TRUE(result.ok()) << result.status();
  if (result.ok()) *loss = *result;
  std::map<std::string, at::Tensor> grads;
  for (const auto& [name, p] : model.parameters()) grads[name] = p.grad().clone();
  return grads;
}

// On 2 data-parallel ranks with 2 micro-batches each: "sum" gives the mean's
// gradients times M * dp and reports the summed loss; per_token_mean with
// equal token counts gives the mean's gradients.
TEST(ParallelModelTest, GradientAndLossReductions) {
  testing::RunOnRanks(2, [](int rank) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    std::vector<Batch> batches = {MicroBatch(2 * rank), MicroBatch(2 * rank + 1)};
    std::map<std::string, std::map<std::string, at::Tensor>> grads;
    std::map<std::string, double> losses;
    for (const char* reduction : {"mean", "sum", "per_token_mean"}) {
      ParallelPlan plan;
      plan.set_dp(2);
      plan.set_num_micro_batches(2);
      plan.set_micro_batch_size(2);
      ReductionSpec::Reduction gradients;
      ASSERT_TRUE(ReductionSpec::Reduction_Parse(reduction, &gradients));
      plan.mutable_reduction()->set_gradients(gradients);
      plan.mutable_reduction()->set_loss(std::string(reduction) == "sum" ? ReductionSpec::sum : ReductionSpec::mean);
      auto model = Parallelize(TinySource(), plan, topology->get(), batches[0], Sgd());
      ASSERT_TRUE(model.ok()) << model.status();
      grads[reduction] = Gradients(**model, batches, &losses[reduction]);
    }
    EXPECT_NEAR(losses["sum"], 4 * losses["mean"], 1e-5);
    EXPECT_NEAR(losses["per_token_mean"], losses["mean"], 1e-6);
    for (const auto& [name, mean] : grads["mean"]) {
      EXPECT_TRUE(torch::allclose(grads["sum"][name], mean * 4, 1e-5, 1e-6)) << name;
      EXPECT_TRUE(torch::allclose(grads["per_token_mean"][name], mean, 1e-5, 1e-7)) << name;
    }
  });
}

// The module traced, run eagerly (trace_method none) and declared as layers
// (trace_method layers) gives the same loss and gradients; a topology with
// only a data axis serves a pipeline of one with recomputation.
TEST(ParallelModelTest, TracedEagerAndLayersAgree) {
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    std::vector<Batch> batches = {MicroBatch(0), MicroBatch(1)};
    std::map<std::string, std::map<std::string, at::Tensor>> grads;
    std::map<std::string, double> losses;
    for (const char* method : {"jit", "none", "layers"}) {
      ParallelPlan plan;
      plan.set_num_micro_batches(2);
      plan.set_micro_batch_size(2);
      TraceSpec::Method trace_method;
      ASSERT_TRUE(TraceSpec::Method_Parse(method, &trace_method));
      plan.mutable_trace()->set_method(trace_method);
      plan.mutable_recompute()->set_method(RecomputeSpec::full);
      ModelSource source = TinySource();
      if (std::string(method) == "layers") {
        auto layers = std::make_shared<TinyLayers>();
        source = ModelSource::FromModule(layers, nullptr);
        source.loss = *LossRegistry().Find("mse");
      }
      auto model = Parallelize(source, plan, topology->get(), batches[0], Sgd());
      ASSERT_TRUE(model.ok()) << method << ": " << model.status();
      grads[method] = Gradients(**model, batches, &losses[method]);
    }
    for (const char* method : {"none", "layers"}) {
      EXPECT_NEAR(losses[method], losses["jit"], 1e-6) << method;
      for (const auto& [name, g] : grads["jit"]) {
        EXPECT_TRUE(torch::allclose(grads[method][name], g, 1e-5, 1e-7)) << method << " " << name;
      }
    }
  });
}

// A net whose second product reads the first's weight under its own name
// (b.weight), as GPT's head reads its token embedding; or a copy of it.
struct TiedNetImpl : torch::nn::Module {
  explicit TiedNetImpl(bool tied) {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(4, 4));
    b = register_module("b", std::make_shared<torch::nn::Module>());
    b_weight = b->register_parameter("weight", tied ? a->weight : a->weight.detach().clone());
    c = register_module("c", torch::nn::Linear(4, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    return c(torch::tanh(torch::nn::functional::linear(torch::tanh(a(x)), b_weight)));
  }
  torch::nn::Linear a{nullptr}, c{nullptr};
  std::shared_ptr<torch::nn::Module> b;
  torch::Tensor b_weight;
};

ModelSource TiedSource(bool tied) {
  auto net = std::make_shared<TiedNetImpl>(tied);
  ModelSource source = ModelSource::FromModule(net, [net](const Values& in) { return Values{net->forward(in[0])}; });
  source.loss = *LossRegistry().Find("mse");
  return source;
}

// no_tie_modules: a traced module's tied weight becomes two tensors and trains
// as the module with an untied copy does (eagerly); a tied module that is not
// traced is refused.
TEST(ParallelModelTest, NoTieModulesUntiesTracedModulesAndRefusesEagerOnes) {
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto train = [&](const ModelSource& source, const std::string& trace_method, bool no_tie_modules) {
      ParallelPlan plan;
      plan.set_micro_batch_size(2);
      TraceSpec::Method method = TraceSpec::jit;
      EXPECT_TRUE(TraceSpec::Method_Parse(trace_method, &method));
      plan.mutable_trace()->set_method(method);
      plan.mutable_trace()->set_no_tie_modules(no_tie_modules);
      std::vector<double> losses;
      auto model = Parallelize(source, plan, topology->get(), MicroBatch(0), Sgd());
      EXPECT_TRUE(model.ok()) << model.status();
      if (!model.ok()) return losses;
      if (no_tie_modules) {
        EXPECT_THAT((*model)->Describe(), HasSubstr("no_tie_modules: b.weight (was a.weight)"));
      }
      for (int step = 0; step < 4; ++step) {
        (*model)->ZeroGrad();
        auto loss = (*model)->ForwardBackward({MicroBatch(step)});
        EXPECT_TRUE(loss.ok() && (*model)->Step(0.5).ok());
        losses.push_back(loss.value_or(0));
      }
      return losses;
    };
    const std::vector<double> untied = train(TiedSource(/*tied=*/true), "jit", true);
    const std::vector<double> reference = train(TiedSource(/*tied=*/false), "none", false);
    ASSERT_EQ(untied.size(), reference.size());
    for (size_t i = 0; i < untied.size(); ++i) EXPECT_NEAR(untied[i], reference[i], 1e-6) << "step " << i;
    EXPECT_NE(train(TiedSource(/*tied=*/true), "jit", false).back(), untied.back()) << "tied trains otherwise";
    ParallelPlan plan;
    plan.set_micro_batch_size(2);
    plan.mutable_trace()->set_method(TraceSpec::none);
    plan.mutable_trace()->set_no_tie_modules(true);
    EXPECT_THAT(
        std::string(Parallelize(TiedSource(true), plan, topology->get(), MicroBatch(0), Sgd()).status().message()),
        HasSubstr("no_tie_modules: the model ties b.weight to a.weight and is not traced"));
  });
}

// TinyNet with ParallelLinear layers, which take LoRA adapters.
struct AdaptableNetImpl : torch::nn::Module {
  AdaptableNetImpl() {
    torch::manual_seed(3);
    a = register_module("a", ParallelLinear(4, 8));
    b = register_module("b", ParallelLinear(8, 8));
    c = register_module("c", ParallelLinear(8, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) {
    torch::Tensor h = torch::tanh(a(x));
    return c(torch::tanh(b(h)) + h);
  }
  ParallelLinear a{nullptr}, b{nullptr}, c{nullptr};
};

// LoRA on a user's module, traced or run eagerly: the same losses, and only
// the adapters get gradients and change; a target nothing matches is refused.
// Rank-2 adapters (scale 2) on `targets`.
LoraConfig Lora(const std::vector<std::string>& targets) {
  LoraConfig lora;
  lora.set_r(2);
  lora.set_alpha(4);
  SetStrings(lora.mutable_target_modules(), targets);
  return lora;
}

TEST(ParallelModelTest, LoraAdaptsAUserModuleTracedOrEager) {
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    std::vector<Batch> batches = {MicroBatch(0)};
    std::map<std::string, std::vector<double>> losses;
    for (const char* method : {"jit", "none"}) {
      ParallelPlan plan;
      plan.set_micro_batch_size(2);
      TraceSpec::Method trace_method;
      ASSERT_TRUE(TraceSpec::Method_Parse(method, &trace_method));
      plan.mutable_trace()->set_method(trace_method);
      *plan.mutable_lora() = Lora({"a", "b"});
      auto net = std::make_shared<AdaptableNetImpl>();
      ModelSource source =
          ModelSource::FromModule(net, [net](const Values& in) { return Values{net->forward(in[0])}; });
      source.loss = *LossRegistry().Find("mse");
      auto model = Parallelize(source, plan, topology->get(), batches[0], Sgd());
      ASSERT_TRUE(model.ok()) << method << ": " << model.status();
      const at::Tensor frozen_before = net->b->weight.clone();
      for (int step = 0; step < 3; ++step) {
        (*model)->ZeroGrad();
        auto loss = (*model)->ForwardBackward(batches);
        ASSERT_TRUE(loss.ok()) << loss.status();
        losses[method].push_back(*loss);
        for (const auto& [name, p] : (*model)->parameters()) {
          EXPECT_EQ(p.grad().defined(), IsAdapterParameter(name)) << method << " " << name;
        }
        ASSERT_TRUE((*model)->Step(0.5).ok());
      }
      EXPECT_TRUE(at::equal(net->b->weight, frozen_before)) << method;
      for (const auto& [name, p] : (*model)->parameters()) {  // traced: adapters in the graph, not the module
        if (name == "b.lora_B.default.weight") {
          EXPECT_GT(p.abs().max().item<double>(), 0) << method << ": B trained";
        }
      }
      EXPECT_NE(losses[method][2], losses[method][0]) << method;
    }
    for (int step = 0; step < 3; ++step) EXPECT_NEAR(losses["none"][step], losses["jit"][step], 1e-6);

    // torch::nn::Linear layers take no adapters as modules; traced, their products do.
    ParallelPlan traced;
    traced.set_micro_batch_size(2);
    *traced.mutable_lora() = Lora({"a", "b"});
    ModelSource plain = TinySource();
    auto plain_model = Parallelize(plain, traced, topology->get(), batches[0], Sgd());
    ASSERT_TRUE(plain_model.ok()) << plain_model.status();
    std::vector<std::string> trainable;
    for (const auto& [name, p] : (*plain_model)->parameters()) {
      if (p.requires_grad()) trainable.push_back(name);
    }
    EXPECT_THAT(trainable, ::testing::UnorderedElementsAre("a.lora_A.default.weight", "a.lora_B.default.weight",
                                                           "b.lora_A.default.weight", "b.lora_B.default.weight"));
    std::vector<double> plain_losses;
    for (int step = 0; step < 3; ++step) {
      (*plain_model)->ZeroGrad();
      auto loss = (*plain_model)->ForwardBackward(batches);
      ASSERT_TRUE(loss.ok()) << loss.status();
      plain_losses.push_back(*loss);
      ASSERT_TRUE((*plain_model)->Step(0.5).ok());
    }
    EXPECT_NE(plain_losses[2], plain_losses[0]) << "the adapters learn";

    ParallelPlan typo;
    typo.set_micro_batch_size(2);
    *typo.mutable_lora() = Lora({"a", "fc9"});
    auto net = std::make_shared<AdaptableNetImpl>();
    ModelSource source = ModelSource::FromModule(net, [net](const Values& in) { return Values{net->forward(in[0])}; });
    source.loss = *LossRegistry().Find("mse");
    auto refused = Parallelize(source, typo, topology->get(), batches[0], Sgd());
    ASSERT_FALSE(refused.ok());
    EXPECT_THAT(std::string(refused.status().message()), HasSubstr("'fc9' matches no module"));
  });
}

// Eight activation-heavy layers (64 -> 256 -> 64 with GELU) declared as a
// LayerSequence: each keeps 9 times its input's size for backward.
class WideLayers : public torch::nn::Module, public LayerSequence {
 public:
  WideLayers() {
    torch::manual_seed(4);
    for (int i = 0; i < 8; ++i) {
      up.push_back(register_module("up" + std::to_string(i), torch::nn::Linear(64, 256)));
      down.push_back(register_module("down" + std::to_string(i), torch::nn::Linear(256, 64)));
    }
  }
  int64_t NumLayers() const override { return 8; }
  std::string LayerName(int64_t i) const override { return "block" + std::to_string(i); }
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override {
    const at::Tensor& x = i == 0 ? batch.at(0) : inputs.at(0);
    return {x + down[i](torch::gelu(up[i](x)))};
  }
  NamedTensors LayerParameters(int64_t i) override {
    return {{"up.weight", up[i]->weight},
            {"up.bias", up[i]->bias},
            {"down.weight", down[i]->weight},
            {"down.bias", down[i]->bias}};
  }
  std::vector<torch::nn::Linear> up, down;
};

// Full recomputation keeps each layer's input and reruns one layer at a time
// in backward: the step's peak of tensor bytes falls well below keeping every
// activation, and the gradients stay the same.
TEST(ParallelModelTest, FullRecomputationHoldsOneLayerAtATime) {
  testing::RunOnRanks(1, [](int) {
    MemoryCounter& counter = MemoryCounter::Install();
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    torch::manual_seed(7);
    const Batch batch = {torch::randn({512, 64}), torch::randn({512, 64})};
    std::map<std::string, int64_t> peak;
    std::map<std::string, std::map<std::string, at::Tensor>> grads;
    for (const char* recompute : {"none", "full"}) {
      ParallelPlan plan;
      plan.set_micro_batch_size(512);
      plan.mutable_trace()->set_method(TraceSpec::layers);
      RecomputeSpec::Method method;
      ASSERT_TRUE(RecomputeSpec::Method_Parse(recompute, &method));
      plan.mutable_recompute()->set_method(method);
      auto layers = std::make_shared<WideLayers>();
      ModelSource source = ModelSource::FromModule(layers, nullptr);
      source.loss = *LossRegistry().Find("mse");
      auto model = Parallelize(source, plan, topology->get(), batch, Sgd());
      ASSERT_TRUE(model.ok()) << model.status();
      double loss = 0;
      Gradients(**model, {batch}, &loss);  // the first step allocates the gradients
      const int64_t before = counter.live_bytes();
      counter.ResetPeak();
      grads[recompute] = Gradients(**model, {batch}, &loss);
      peak[recompute] = counter.peak_bytes() - before;
    }
    EXPECT_LT(peak["full"], peak["none"] / 2) << "none " << peak["none"] << " bytes, full " << peak["full"];
    for (const auto& [name, g] : grads["none"]) EXPECT_TRUE(torch::allclose(grads["full"][name], g)) << name;
  });
}

// After the first step (which allocates gradients and AdamW's state), a
// training step leaves exactly the tensor bytes it found, peaks at the same
// bytes and makes the same allocations as every other: nothing grows from
// step to step.
TEST(ParallelModelTest, StepsAfterTheFirstAllocateNothingNew) {
  testing::RunOnRanks(1, [](int) {
    MemoryCounter& counter = MemoryCounter::Install();
    auto topology = testing::JoinTopology({{"data", 1}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    torch::manual_seed(7);
    const Batch batch = {torch::randn({128, 64}), torch::randn({128, 64})};
    ParallelPlan plan;
    plan.set_micro_batch_size(64);
    plan.set_num_micro_batches(2);
    plan.mutable_trace()->set_method(TraceSpec::layers);
    ModelSource source = ModelSource::FromModule(std::make_shared<WideLayers>(), nullptr);
    source.loss = *LossRegistry().Find("mse");
    const std::vector<Batch> micro_batches = {{batch[0].narrow(0, 0, 64), batch[1].narrow(0, 0, 64)},
                                              {batch[0].narrow(0, 64, 64), batch[1].narrow(0, 64, 64)}};
    auto model =
        Parallelize(source, plan, topology->get(), micro_batches[0], *MakeOptimizerFactory("adamw", ComponentArgs()));
    ASSERT_TRUE(model.ok()) << model.status();
    struct StepMemory {
      int64_t live_after, peak, allocations;
    };
    std::vector<StepMemory> steps;
    for (int step = 0; step < 5; ++step) {
      const int64_t before = counter.live_bytes(), allocations = counter.allocations();
      counter.ResetPeak();
      (*model)->ZeroGrad();
      ASSERT_TRUE((*model)->ForwardBackward(micro_batches).ok());
      ASSERT_TRUE((*model)->ClipGradNorm(1.0).ok());
      ASSERT_TRUE((*model)->Step(1e-3).ok());
      steps.push_back({counter.live_bytes(), counter.peak_bytes() - before, counter.allocations() - allocations});
    }
    for (int step = 2; step < 5; ++step) {
      EXPECT_EQ(steps[step].live_after, steps[1].live_after) << "step " << step;
      EXPECT_EQ(steps[step].peak, steps[1].peak) << "step " << step;
      EXPECT_EQ(steps[step].allocations, steps[1].allocations) << "step " << step;
    }
    EXPECT_EQ(steps[1].live_after, steps[0].live_after) << "the first step's gradients and state stay, nothing more";
    std::printf("a step: %lld allocations, peak %lld bytes above its start\n",
                static_cast<long long>(steps[1].allocations), static_cast<long long>(steps[1].peak));
    MemoryCounter::Uninstall();
  });
}

// Problems found while setting up on one stage reach every rank as errors
// before any step, and problems of the plan and source come first.
TEST(ParallelModelTest, SetupErrorsReachEveryRank) {
  testing::RunOnRanks(2, [](int rank) {
    auto topology = testing::JoinTopology({{"pipeline", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    ParallelPlan plan;
    plan.set_pp(2);
    plan.set_num_micro_batches(2);
    plan.set_micro_batch_size(2);
    plan.mutable_trace()->set_split_method("nearest_min_deps");
    plan.mutable_trace()->set_shard_count(3);
    const Batch example = MicroBatch(0);
    // The loss is not a scalar: the last stage finds out, both ranks fail.
    auto vector_loss =
        Parallelize(TinySource([](const Batch& b, const Values& out) { return (out[0] - b.back()).pow(2); }), plan,
                    topology->get(), example, Sgd());
    ASSERT_FALSE(vector_loss.ok());
    EXPECT_THAT(std::string(vector_loss.status().message()),
                HasSubstr(rank == 1 ? "the loss must be a floating-point scalar" : "rank 1 failed"));
    // Checked before any rank builds anything.
    ModelSource no_loss = TinySource();
    no_loss.loss = nullptr;
    plan.mutable_trace()->set_method(TraceSpec::none);
    EXPECT_THAT(std::string(Parallelize(no_loss, plan, topology->get(), example, Sgd()).status().message()),
                HasSubstr("trace_method=none runs the model whole"));
    plan.mutable_trace()->set_method(TraceSpec::jit);
    plan.mutable_trace()->set_split_method("layer_split");
    EXPECT_THAT(std::string(Parallelize(no_loss, plan, topology->get(), example, Sgd()).status().message()),
                HasSubstr("a traced model is cut with farthest_min_deps or nearest_min_deps"));
    plan.mutable_trace()->set_split_method("nearest_min_deps");
    plan.set_tp(2);
    plan.mutable_trace()->set_method(TraceSpec::none);
    EXPECT_THAT(std::string(CheckSource(no_loss, plan).message()), HasSubstr("trace it (trace_method=jit)"));
    plan.mutable_trace()->set_method(TraceSpec::jit);
    plan.set_tp(1);
    plan.set_dp(2);
    EXPECT_THAT(std::string(Parallelize(no_loss, plan, topology->get(), example, Sgd()).status().message()),
                HasSubstr("dp*tp*pp = 4 but the job has 2 ranks"));
    plan.set_dp(1);
    // The model computes no loss and none is given.
    auto missing = Parallelize(no_loss, plan, topology->get(), example, Sgd());
    ASSERT_FALSE(missing.ok());
    EXPECT_THAT(std::string(missing.status().message()),
                HasSubstr(rank == 1 ? "hold no scalar loss" : "rank 1 failed"));
  });
}

}  // namespace
}  // namespace trident

#include <torch/script.h>

namespace trident {
namespace {

// A TorchScript file's layers hold no parameter values until a rank that keeps
// a layer reads them (MaterializeLayer), where nothing reads them first: at
// tp=1; a plan that copies them first (no_tie_modules) loads the file whole.
TEST(ParallelizeTest, TorchScriptValuesAreReadByTheLayersThatKeepThem) {
  torch::manual_seed(5);
  torch::jit::Module scripted("TwoLayers");
  scripted.register_parameter("w1", torch::randn({4, 1024}).requires_grad_(), false);
  scripted.register_parameter("w2", torch::randn({1024, 1}).requires_grad_(), false);
  scripted.define(R"(
    def forward(self, x, target):
        h = torch.tanh(torch.matmul(x, self.w1))
        return (torch.matmul(h, self.w2) - target).pow(2).mean()
  )");
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/two_layers.pt";
  scripted.save(path);
  ParallelPlan plan;
  plan.mutable_trace()->set_shard_count(2);
  auto layers = LayersOf(ModelSource::FromTorchScript(path), plan, MicroBatch(0));
  ASSERT_TRUE(layers.ok()) << layers.status();
  EXPECT_TRUE(layers->values_deferred);
  auto part = layers->layers.build({});
  ASSERT_TRUE(part.ok()) << part.status();
  ASSERT_EQ((*part)->NumLayers(), 2);
  for (int64_t i = 0; i < 2; ++i) {
    for (const auto& [name, p] : (*part)->LayerParameters(i)) {
      EXPECT_EQ(p.abs().sum().item<float>(), 0.0f) << name << " was read before its layer asked";
    }
  }
  (*part)->MaterializeLayer(1);
  for (const auto& [name, p] : (*part)->LayerParameters(1)) {
    EXPECT_TRUE(torch::equal(p, scripted.attr(name).toTensor())) << name;
  }
  for (const auto& [name, p] : (*part)->LayerParameters(0)) {
    if (name != "w2") {
      EXPECT_EQ(p.abs().sum().item<float>(), 0.0f) << name << " was read with layer 1";
    }
  }

  plan.mutable_trace()->set_no_tie_modules(true);
  auto whole = LayersOf(ModelSource::FromTorchScript(path), plan, MicroBatch(0));
  ASSERT_TRUE(whole.ok()) << whole.status();
  EXPECT_FALSE(whole->values_deferred);
}

}  // namespace
}  // namespace trident
