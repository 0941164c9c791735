// LoRA adapters on plain and tensor-parallel linear layers against the
// computation written out, and the configuration file, exports and merging.
#include "lora/lora.h"

#include <fstream>

#include <ATen/CPUGeneratorImpl.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "base/text_proto.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

// fc1 -> gelu -> fc2 over a norm, with a bias on each linear layer.
struct NetImpl : torch::nn::Module {
  NetImpl() {
    fc1 = register_module("fc1", ParallelLinear(8, 16));
    fc2 = register_module("fc2", ParallelLinear(16, 8));
    norm = register_module("norm", torch::nn::LayerNorm(torch::nn::LayerNormOptions({8})));
  }
  at::Tensor forward(const at::Tensor& x) { return fc2->forward(at::gelu(fc1->forward(norm->forward(x)))); }
  ParallelLinear fc1{nullptr}, fc2{nullptr};
  torch::nn::LayerNorm norm{nullptr};
};
TORCH_MODULE(Net);

Net SeededNet() {
  torch::manual_seed(7);
  return Net();
}

at::Tensor Shared(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, generator);
}

void ExpectClose(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double diff = (actual - expected).abs().max().item<double>();
  EXPECT_LE(diff, 1e-5 * std::max(1.0, expected.abs().max().item<double>())) << what << ": max diff " << diff;
}

LoraConfig Options() {
  LoraConfig lora;
  lora.set_r(4);
  lora.set_alpha(8);
  SetStrings(lora.mutable_target_modules(), {"fc1", "fc2"});
  return lora;
}

NamedTensors Parameters(torch::nn::Module& module) {
  NamedTensors all;
  for (const auto& item : module.named_parameters()) all.emplace_back(item.key(), item.value());
  return all;
}

// Gives every lora_B of `net` values (they start at zero), the same in every process.
void FillB(torch::nn::Module& net) {
  torch::NoGradGuard no_grad;
  uint64_t seed = 100;
  for (auto& item : net.named_parameters()) {
    if (item.key().find("lora_B") != std::string::npos) item.value().copy_(Shared(item.value().sizes().vec(), ++seed));
  }
}

TEST(LoraTest, AdaptersStartAtZeroAddTheirProductAndAloneTrain) {
  Net net = SeededNet();
  const at::Tensor x = Shared({3, 5, 8}, 1);
  const at::Tensor before = net->forward(x).detach();
  auto adapted = ApplyLora(*net, Options(), /*seed=*/1);
  ASSERT_TRUE(adapted.ok()) << adapted.status();
  EXPECT_EQ(adapted->adapted, (std::vector<std::string>{"fc1", "fc2"}));
  EXPECT_EQ(adapted->trainable_parameters, 4 * 8 + 16 * 4 + 4 * 16 + 8 * 4);
  ExpectClose(net->forward(x), before, "B = 0: the adapted model computes the base model");
  for (const auto& [name, p] : Parameters(*net)) {
    EXPECT_EQ(p.requires_grad(), IsAdapterParameter(name)) << name;
  }
  const at::Tensor a1 = net->named_parameters()["fc1.lora_A.default.weight"];
  EXPECT_LE(a1.abs().max().item<double>(), 1.0 / std::sqrt(8.0));  // Kaiming-uniform over fan-in 8
  EXPECT_GT(a1.abs().max().item<double>(), 0.0);

  FillB(*net);
  auto p = net->named_parameters();
  const double scale = 8.0 / 4.0;
  auto lora_linear = [&](const std::string& l, const at::Tensor& in) {
    return at::linear(in, p[l + ".weight"], p[l + ".bias"]) +
           scale * at::linear(at::linear(in, p[l + ".lora_A.default.weight"]), p[l + ".lora_B.default.weight"]);
  };
  const at::Tensor expected = lora_linear("fc2", at::gelu(lora_linear("fc1", net->norm->forward(x))));
  at::Tensor y = net->forward(x);
  ExpectClose(y, expected, "forward with adapters");
  y.sum().backward();
  for (const auto& [name, t] : Parameters(*net)) {
    EXPECT_EQ(t.grad().defined(), IsAdapterParameter(name)) << name;
  }
}

TEST(LoraTest, BiasAndModulesToSaveChooseWhatElseTrains) {
  Net net = SeededNet();
  LoraConfig lora = Options();
  SetStrings(lora.mutable_target_modules(), {"fc1"});
  lora.set_bias("lora_only");
  SetStrings(lora.mutable_modules_to_save(), {"norm"});
  ASSERT_TRUE(ApplyLora(*net, lora, 1).ok());
  auto p = net->named_parameters();
  EXPECT_TRUE(p["fc1.bias"].requires_grad());
  EXPECT_FALSE(p["fc2.bias"].requires_grad());
  EXPECT_FALSE(p["fc1.weight"].requires_grad());
  EXPECT_TRUE(p["norm.weight"].requires_grad());
  EXPECT_TRUE(p["norm.bias"].requires_grad());
  const NamedTensors peft = PeftAdapter(Parameters(*net), lora);
  std::vector<std::string> names;
  for (const auto& [name, t] : peft) names.push_back(name);
  EXPECT_THAT(names,
              ::testing::UnorderedElementsAre("base_model.model.fc1.bias", "base_model.model.fc1.lora_A.default.weight",
                                              "base_model.model.fc1.lora_B.default.weight",
                                              "base_model.model.norm.weight", "base_model.model.norm.bias"));
}

TEST(LoraTest, TargetsThatAreNotLinearLayersAreRefused) {
  Net net = SeededNet();
  LoraConfig lora = Options();
  SetStrings(lora.mutable_target_modules(), {"norm"});
  auto adapted = ApplyLora(*net, lora, 1);
  ASSERT_FALSE(adapted.ok());
  EXPECT_THAT(std::string(adapted.status().message()), HasSubstr("LoRA target 'norm' is a"));
  EXPECT_THAT(std::string(adapted.status().message()), HasSubstr("not a linear layer"));
  SetStrings(lora.mutable_target_modules(), {"fc3"});
  adapted = ApplyLora(*net, lora, 1);
  ASSERT_TRUE(adapted.ok());
  EXPECT_EQ(adapted->target_hits, std::vector<int>{0});  // Parallelize refuses a target no stage matches
}

TEST(LoraTest, MergedWeightsComputeWhatTheAdaptedModelDoes) {
  Net net = SeededNet();
  LoraConfig lora = Options();
  ASSERT_TRUE(ApplyLora(*net, lora, 1).ok());
  FillB(*net);
  const at::Tensor x = Shared({2, 8}, 3);
  const at::Tensor adapted_output = net->forward(x).detach();
  auto merged = MergeAdapters(Parameters(*net), lora);
  ASSERT_TRUE(merged.ok()) << merged.status();
  Net plain = SeededNet();
  auto p = net->named_parameters();
  torch::NoGradGuard no_grad;
  for (const auto& [name, t] : *merged) {
    EXPECT_FALSE(IsAdapterParameter(name)) << name;
    plain->named_parameters()[name].copy_(t);
  }
  const at::Tensor w = plain->named_parameters()["fc1.weight"];
  ExpectClose(w, p["fc1.weight"] + 2.0 * at::mm(p["fc1.lora_B.default.weight"], p["fc1.lora_A.default.weight"]),
              "W + scale * B A");
  ExpectClose(plain->forward(x), adapted_output, "the merged model");
}

TEST(LoraTest, ConfigFilesAreReadAndCheckedNamingTheFile) {
  const std::string dir = ::testing::TempDir();
  const std::string good = dir + "/lora.pbtxt", bad = dir + "/bad.pbtxt", empty = dir + "/empty.pbtxt";
  std::ofstream(good) << "r: 16\nalpha: 32\ndropout: 0.05\ntarget_modules: \"c_attn\"\ntarget_modules: \"c_fc\"\n"
                         "bias: \"all\"\n";
  std::ofstream(bad) << "rank: 4\n";
  std::ofstream(empty) << "r: 4\n";
  auto read = ReadLoraConfig(good, "sft");
  ASSERT_TRUE(read.ok()) << read.status();
  EXPECT_EQ(read->r(), 16);
  EXPECT_DOUBLE_EQ(LoraScale(*read), 2.0);
  EXPECT_DOUBLE_EQ(read->dropout(), 0.05);
  EXPECT_EQ(std::vector<std::string>(read->target_modules().begin(), read->target_modules().end()),
            (std::vector<std::string>{"c_attn", "c_fc"}));
  EXPECT_EQ(read->bias(), "all");
  EXPECT_EQ(read->adapter_name(), "sft");
  auto unreadable = ReadLoraConfig(bad, "default");
  EXPECT_THAT(std::string(unreadable.status().message()), HasSubstr(bad));
  EXPECT_THAT(std::string(unreadable.status().message()), HasSubstr("rank"));
  EXPECT_THAT(std::string(ReadLoraConfig(empty, "default").status().message()), HasSubstr("target_modules is empty"));
  EXPECT_THAT(std::string(ReadLoraConfig(good, "a.b").status().message()), HasSubstr("adapter_name"));
  EXPECT_EQ(ReadLoraConfig(dir + "/missing.pbtxt", "default").status().code(), absl::StatusCode::kNotFound);
}

// A column-parallel fc1 and row-parallel fc2 with adapters at tp = 2 compute
// the single-process outputs and gradients, each rank its slices.
TEST(LoraTest, TensorParallelAdaptersEqualOneProcess) {
  Net whole = SeededNet();
  ASSERT_TRUE(ApplyLora(*whole, Options(), 1).ok());
  FillB(*whole);
  const at::Tensor x = Shared({3, 5, 8}, 1);
  whole->forward(x).pow(2).sum().backward();
  testing::RunOnRanks(2, [&](int rank) {
    auto topology = testing::JoinTopology({{"tensor", 2}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    Net net = SeededNet();
    const TensorParallelism tp{2, rank, "tp"};
    ASSERT_TRUE(ApplyTensorParallel(*net, {{"fc1"}, {"fc2"}, {}}, tp).ok());
    auto adapted = ApplyLora(*net, Options(), 1);
    ASSERT_TRUE(adapted.ok()) << adapted.status();
    EXPECT_EQ(adapted->shards.size(), 2u);  // fc1's B by rows, fc2's A by columns
    auto full = whole->named_parameters();
    {
      torch::NoGradGuard no_grad;
      for (auto& item : net->named_parameters()) {  // B: the single process's values, sliced
        if (item.key().find("lora_B") == std::string::npos) continue;
        auto spec = adapted->shards.find(item.key());
        const at::Tensor value = full[item.key()];
        item.value().copy_(spec == adapted->shards.end() ? value : spec->second.Slice(value));
      }
    }
    at::Tensor y = net->forward(x);
    ExpectClose(y, whole->forward(x).detach(), "output");
    y.pow(2).sum().backward();
    for (auto& item : net->named_parameters()) {
      if (!IsAdapterParameter(item.key())) continue;
      auto spec = adapted->shards.find(item.key());
      const at::Tensor grad = full[item.key()].grad();
      ExpectClose(item.value().grad(), spec == adapted->shards.end() ? grad : spec->second.Slice(grad),
                  item.key() + " gradient");
      auto a = item.value();
      if (spec == adapted->shards.end()) {
        ExpectClose(a, full[item.key()], item.key() + " replicated value");
      } else {
        ExpectClose(a, spec->second.Slice(full[item.key()]), item.key() + " sliced value");
      }
    }
  });
}

}  // namespace
}  // namespace trident
