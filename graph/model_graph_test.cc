#include "graph/model_graph.h"

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "testing/tiny_model.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

TEST(ModelGraphTest, NodesCarryParametersShapesAndFlops) {
  testing::TinyModelOptions config;
  config.n_layer = 1;
  config.n_embd = 8;
  config.vocab_size = 16;
  auto model = std::make_shared<testing::TinyModel>(config, 1);
  auto tokens = torch::randint(16, {2, 4}, torch::kLong);
  auto graph = ModelGraph::Trace(*model, {tokens}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model->Logits(in[0])};
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  // One aten::linear node per linear layer, reading its weight and bias.
  const GraphNode* product = nullptr;
  for (const GraphNode& node : (*graph)->nodes()) {
    if (node.kind == "aten::linear" &&
        node.parameters == std::vector<std::string>{"blocks.0.fc1.weight", "blocks.0.fc1.bias"}) {
      product = &node;
    }
  }
  ASSERT_NE(product, nullptr) << (*graph)->IrText();
  EXPECT_EQ(product->output_shapes[0], (std::vector<int64_t>{2, 4, 32}));
  EXPECT_EQ(product->parameter_bytes, (32 * 8 + 32) * 4);
  EXPECT_EQ(product->forward_flops, 2.0 * 2 * 4 * 32 * 8);
  EXPECT_EQ(product->activation_bytes, 2 * 4 * 32 * 4);
  EXPECT_EQ(product->output_dtypes[0], "Float");
  EXPECT_THAT((*graph)->Summary(), HasSubstr("aten::linear"));
  EXPECT_THAT((*graph)->Summary(), HasSubstr("total: "));
}

// A forward that branches on a tensor's value cannot be traced faithfully.
struct DataDependentImpl : torch::nn::Module {
  DataDependentImpl() { fc = register_module("fc", torch::nn::Linear(4, 4)); }
  torch::Tensor forward(const torch::Tensor& x) {
    auto y = fc(x);
    return y.sum().item<float>() > 0 ? y * 2 : y * 3;
  }
  torch::nn::Linear fc{nullptr};
};

TEST(ModelGraphTest, DataDependentControlFlowIsAClearError) {
  DataDependentImpl module;
  torch::manual_seed(0);
  auto x = torch::randn({2, 4});
  auto forward = [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{module.forward(in[0])}; };
  // Find a check input that takes the other branch.
  const bool positive = module.forward(x).sum().item<float>() > 0;
  at::Tensor other;
  for (int attempt = 0; attempt < 100 && !other.defined(); ++attempt) {
    auto candidate = torch::randn({2, 4}) * 3;
    if ((module.fc(candidate).sum().item<float>() > 0) != positive) other = candidate;
  }
  ASSERT_TRUE(other.defined());
  auto graph = ModelGraph::Trace(module, {x}, forward, {other});
  ASSERT_FALSE(graph.ok()) << (*graph)->IrText();
  EXPECT_THAT(std::string(graph.status().message()),
              HasSubstr("the traced graph disagrees with the model on check_inputs"));
  EXPECT_THAT(std::string(graph.status().message()), HasSubstr("Declare the model as a LayerSequence"));
}

// no_tie_modules: the reads of a tied tensor go, in graph order, to its names
// in the order Trace was given them, each name a tensor of its own.
TEST(ModelGraphTest, UntieGivesEachNameOfATiedTensorItsOwnReader) {
  torch::manual_seed(0);
  const at::Tensor w = torch::randn({4, 4}).requires_grad_(), x = torch::randn({2, 4});
  const std::vector<std::pair<std::string, at::Tensor>> tied = {{"embed.weight", w}, {"head.weight", w}};
  auto twice = [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{at::linear(at::tanh(at::linear(in[0], w)), w).pow(2).sum()};
  };
  auto graph = ModelGraph::Trace(tied, {x}, twice);
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ((*graph)->aliases(), (std::map<std::string, std::string>{{"head.weight", "embed.weight"}}));
  auto untied = (*graph)->Untie();
  ASSERT_TRUE(untied.ok()) << untied.status();
  EXPECT_EQ(untied->untied, std::vector<std::string>{"head.weight (was embed.weight)"});
  ASSERT_EQ(untied->parameters.size(), 2u);
  EXPECT_EQ(untied->parameters[1].first, "head.weight");
  EXPECT_FALSE(untied->parameters[1].second.is_same(w));
  EXPECT_TRUE(at::equal(untied->parameters[1].second, w));
  auto retraced = ModelGraph::Trace(untied->parameters, {x}, untied->forward);
  ASSERT_TRUE(retraced.ok()) << retraced.status();
  EXPECT_TRUE((*retraced)->aliases().empty());
  auto loss = (*retraced)->Run({x});
  ASSERT_TRUE(loss.ok()) << loss.status();
  (*loss)[0].backward();
  // The same computation with two tensors from the start.
  const at::Tensor first = w.detach().clone().requires_grad_(), second = w.detach().clone().requires_grad_();
  const at::Tensor expected = at::linear(at::tanh(at::linear(x, first)), second).pow(2).sum();
  expected.backward();
  EXPECT_NEAR((*loss)[0].item<double>(), expected.item<double>(), 1e-5);
  EXPECT_TRUE(torch::allclose(untied->parameters[0].second.grad(), first.grad(), 1e-5, 1e-6));
  EXPECT_TRUE(torch::allclose(untied->parameters[1].second.grad(), second.grad(), 1e-5, 1e-6));
  EXPECT_FALSE(torch::allclose(first.grad(), second.grad(), 1e-2, 1e-2)) << "the two reads have their own gradients";

  // Three reads of a tensor with two names: which reads which is unknown.
  auto thrice = [&](const std::vector<at::Tensor>& in) {
    const at::Tensor penalty = w.sum();
    return std::vector<at::Tensor>{at::linear(at::tanh(at::linear(in[0], w)), w).pow(2).sum() + penalty};
  };
  graph = ModelGraph::Trace(tied, {x}, thrice);
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_THAT(std::string((*graph)->Untie().status().message()),
              HasSubstr("the tied parameter embed.weight = head.weight has 2 names but 3 operator(s) read it in the "
                        "traced graph (aten::sum, aten::linear, aten::linear)"));
}

}  // namespace
}  // namespace trident

#include <torch/script.h>

namespace trident {
namespace {

// A TorchScript module (as saved from Python with torch.jit.save) traces into a
// graph whose parameters are named inputs and whose results and gradients
// match the scripted module's.
TEST(ModelGraphTest, TorchScriptModulesFromThePythonEcosystemTrace) {
  torch::manual_seed(0);
  torch::jit::Module scripted("TinyNet");
  scripted.register_parameter("w1", torch::randn({4, 8}).requires_grad_(), false);
  scripted.register_parameter("b1", torch::zeros({8}).requires_grad_(), false);
  scripted.register_parameter("w2", torch::randn({8, 3}).requires_grad_(), false);
  scripted.define(R"(
    def forward(self, x, target):
        h = torch.tanh(torch.matmul(x, self.w1) + self.b1)
        for _ in range(2):
            h = h * 0.5 + torch.tanh(h)
        return (torch.matmul(h, self.w2) - target).pow(2).mean()
  )");
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/tiny_net.pt";
  scripted.save(path);

  auto x = torch::randn({5, 4}), target = torch::randn({5, 3});
  auto x2 = torch::randn({5, 4}), target2 = torch::randn({5, 3});
  auto graph = ModelGraph::FromTorchScript(path, {x, target}, {x2, target2});
  ASSERT_TRUE(graph.ok()) << graph.status();
  EXPECT_EQ((*graph)->parameter_names(), (std::vector<std::string>{"w1", "b1", "w2"}));
  auto loss = (*graph)->Run({x2, target2});
  ASSERT_TRUE(loss.ok()) << loss.status();
  (*loss)[0].backward();

  torch::jit::Module reference = torch::jit::load(path);
  auto expected = reference.forward({x2, target2}).toTensor();
  expected.backward();
  EXPECT_NEAR((*loss)[0].item<double>(), expected.item<double>(), 1e-6);
  size_t i = 0;
  for (const auto& item : reference.named_parameters()) {
    ASSERT_LT(i, (*graph)->parameters().size());
    EXPECT_EQ((*graph)->parameter_names()[i], item.name);
    EXPECT_TRUE(torch::allclose((*graph)->parameters()[i].grad(), item.value.grad(), 1e-5, 1e-7)) << item.name;
    ++i;
  }
  EXPECT_THAT(std::string(ModelGraph::FromTorchScript("/nonexistent.pt", {x}).status().message()),
              HasSubstr("loading TorchScript module /nonexistent.pt"));
}

}  // namespace
}  // namespace trident

#include "base/memory_counter.h"

namespace trident {
namespace {

// Loaded with defer_values, a TorchScript file's parameters hold no resident
// memory and read as zeros until read_values reads them (each once, to the
// values saved); buffers and small records are read at once; the forward of
// the deferred module then matches the whole load's.
TEST(ModelGraphTest, TorchScriptParameterValuesAreReadOnlyWhenAsked) {
  torch::manual_seed(0);
  torch::jit::Module scripted("Wide");
  scripted.register_parameter("w", torch::randn({4096, 2048}).requires_grad_(), false);  // 32 MiB
  scripted.register_parameter("b", torch::randn({16}).requires_grad_(), false);
  scripted.register_buffer("scale", torch::rand({2048}) + 0.5);  // 8 KiB: deferred size, not a parameter
  scripted.define(R"(
    def forward(self, x):
        return (torch.matmul(x, self.w) * self.scale).sum() + self.b.sum()
  )");
  const char* dir = std::getenv("TEST_TMPDIR");
  const std::string path = std::string(dir ? dir : "/tmp") + "/wide.pt";
  scripted.save(path);
  const torch::jit::Module whole = torch::jit::load(path);
  const at::Tensor x = torch::randn({3, 4096});
  const at::Tensor expected = const_cast<torch::jit::Module&>(whole).forward({x}).toTensor();

  const int64_t before = ResidentBytes();
  auto loaded = TorchScriptModule::Load(path, /*defer_values=*/true);
  ASSERT_TRUE(loaded.ok()) << loaded.status();
  ASSERT_TRUE(loaded->read_values);
  EXPECT_LT(ResidentBytes() - before, 8 << 20) << "the 32 MiB weight was read on load";
  std::map<std::string, at::Tensor> parameters(loaded->parameters.begin(), loaded->parameters.end());
  EXPECT_EQ(parameters.at("w").abs().sum().item<float>(), 0.0f);
  EXPECT_TRUE(torch::equal(parameters.at("b"), whole.attr("b").toTensor()));
  // The trace runs on the zeros: the buffer was read, the weight was not.
  EXPECT_NEAR(loaded->forward({x})[0].item<float>(), whole.attr("b").toTensor().sum().item<float>(), 1e-4);

  loaded->read_values({parameters.at("w").view({-1}), parameters.at("b")});
  EXPECT_GT(ResidentBytes() - before, 24 << 20) << "reading the weight made it resident";
  EXPECT_TRUE(torch::equal(parameters.at("w"), whole.attr("w").toTensor()));
  EXPECT_NEAR(loaded->forward({x})[0].item<float>(), expected.item<float>(), 1e-3);
  // A second read leaves values written since alone.
  {
    torch::NoGradGuard no_grad;
    parameters.at("w").fill_(1.0f);
  }
  loaded->read_values({parameters.at("w")});
  EXPECT_EQ(parameters.at("w").min().item<float>(), 1.0f);

  EXPECT_THAT(std::string(TorchScriptModule::Load("/nonexistent.pt", true).status().message()),
              HasSubstr("loading TorchScript module /nonexistent.pt"));
}

}  // namespace
}  // namespace trident
