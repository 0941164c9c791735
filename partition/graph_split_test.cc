#include <map>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "partition/partition.h"
#include "testing/tiny_model.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

// Runs the stages in sequence, each receiving fresh leaf tensors (as after a
// receive), then backward stage by stage; returns the loss.
at::Tensor RunStages(const ModelGraph& graph, const std::vector<std::unique_ptr<StageGraph>>& stages,
                     const std::vector<at::Tensor>& inputs) {
  std::map<int64_t, at::Tensor> produced;
  std::map<int64_t, std::vector<at::Tensor>> consumers;  // leaves made from each sent tensor
  std::vector<std::vector<at::Tensor>> outputs(stages.size());
  for (size_t s = 0; s < stages.size(); ++s) {
    std::vector<at::Tensor> received;
    for (int64_t id : stages[s]->received()) {
      at::Tensor leaf = produced.at(id).detach().requires_grad_(true);
      consumers[id].push_back(leaf);
      received.push_back(leaf);
    }
    auto out = stages[s]->Run(received, inputs);
    EXPECT_TRUE(out.ok()) << out.status();
    outputs[s] = *out;
    for (size_t i = 0; i < out->size(); ++i) produced[stages[s]->sent()[i]] = (*out)[i];
  }
  at::Tensor loss = produced.at(graph.output_ids()[0]);
  loss.backward();
  for (int s = static_cast<int>(stages.size()) - 2; s >= 0; --s) {
    std::vector<at::Tensor> tensors, grads;
    for (size_t i = 0; i < outputs[s].size(); ++i) {
      at::Tensor grad;
      for (const at::Tensor& leaf : consumers[stages[s]->sent()[i]]) {
        if (leaf.grad().defined()) grad = grad.defined() ? grad + leaf.grad() : leaf.grad();
      }
      if (grad.defined() && outputs[s][i].requires_grad()) {
        tensors.push_back(outputs[s][i]);
        grads.push_back(grad);
      }
    }
    if (!tensors.empty()) torch::autograd::backward(tensors, grads);
  }
  return loss;
}

// Equal up to fp32 rounding: the traced stages sum the gradients of values
// read across a boundary in another order than the eager backward.
void ExpectSameGradients(torch::nn::Module& split, torch::nn::Module& whole) {
  auto expected = whole.named_parameters();
  for (const auto& item : split.named_parameters()) {
    ASSERT_TRUE(item.value().grad().defined()) << item.key();
    EXPECT_TRUE(torch::allclose(item.value().grad(), expected[item.key()].grad(), 1e-5, 1e-6)) << item.key();
  }
}

struct Case {
  bool tied;  // the head reads the token embedding
  const char* split_method;
  const char* partition_method;
  int stages;
};

class GraphSplitTest : public ::testing::TestWithParam<Case> {};

// A leaf module (Merak's leaf_modules, here by parameter-name prefix) is never
// cut: no shard boundary falls between the first and the last operator that
// reads its parameters, though without it the split cuts there.
TEST(LeafModulesTest, NoCutInsideALeafModule) {
  testing::TinyModelOptions config;
  config.n_layer = 2;
  auto model = std::make_shared<testing::TinyModel>(config, 9);
  auto tokens = torch::randint(config.vocab_size, {2, 16}, torch::kLong);
  auto graph = ModelGraph::Trace(*model, {tokens, tokens}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model->Loss(in[0], in[1])};
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  int64_t first = -1, last = -1;
  for (int64_t i = 0; i < static_cast<int64_t>((*graph)->nodes().size()); ++i) {
    for (const std::string& name : (*graph)->nodes()[i].parameters) {
      if (name.rfind("blocks.0.", 0) != 0) continue;
      if (first < 0) first = i;
      last = i;
    }
  }
  ASSERT_GE(first, 0);
  auto inside = [&](const std::vector<int64_t>& bounds) {
    return std::count_if(bounds.begin(), bounds.end(), [&](int64_t b) { return first < b && b <= last; });
  };
  for (const char* method : {"farthest_min_deps", "nearest_min_deps"}) {
    SCOPED_TRACE(method);
    auto free = SplitIntoShards(**graph, method, 12);
    auto kept = SplitIntoShards(**graph, method, 12, {"blocks.0"});
    ASSERT_TRUE(free.ok() && kept.ok());
    EXPECT_GT(inside(*free), 0);
    EXPECT_EQ(inside(*kept), 0);
  }
}

TEST_P(GraphSplitTest, StagesOfTheTracedGraphEqualTheEagerModel) {
  const Case c = GetParam();
  testing::TinyModelOptions config;
  config.n_layer = 2;
  config.tie_embeddings = c.tied;
  auto traced = std::make_shared<testing::TinyModel>(config, 9);
  auto eager = std::make_shared<testing::TinyModel>(config, 9);
  torch::manual_seed(2);
  auto tokens = torch::randint(config.vocab_size, {2, 16}, torch::kLong);
  auto targets = torch::randint(config.vocab_size, {2, 16}, torch::kLong);
  auto graph = ModelGraph::Trace(*traced, {tokens, targets}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{traced->Loss(in[0], in[1])};
  });
  ASSERT_TRUE(graph.ok()) << graph.status();
  GraphPartitionOptions options;
  options.split_method = c.split_method;
  options.partition_method = c.partition_method;
  options.num_stages = c.stages;  // shard_count: the default, 2 * n_layer + 4
  auto plan = PlanGraphStages(**graph, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  auto stages = (*graph)->Split({plan->boundaries().begin(), plan->boundaries().end()});
  ASSERT_TRUE(stages.ok()) << stages.status();
  ASSERT_EQ(stages->size(), static_cast<size_t>(c.stages));
  at::Tensor loss = RunStages(**graph, *stages, {tokens, targets});
  at::Tensor reference = eager->Loss(tokens, targets);
  reference.backward();
  EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-6);
  ExpectSameGradients(*traced, *eager);
}

std::vector<Case> AllCases() {
  std::vector<Case> cases;
  for (bool tied : {false, true}) {
    for (const char* split : {"farthest_min_deps", "nearest_min_deps"}) {
      for (const char* method : {"uniform", "parameters", "cost"}) {
        for (int stages = 1; stages <= 4; ++stages) cases.push_back({tied, split, method, stages});
      }
    }
  }
  return cases;
}

INSTANTIATE_TEST_SUITE_P(SplitAndPartitionMethods, GraphSplitTest, ::testing::ValuesIn(AllCases()),
                         [](const auto& info) {
                           return std::string(info.param.tied ? "tied_" : "") + info.param.split_method + "_" +
                                  info.param.partition_method + "_" + std::to_string(info.param.stages);
                         });

// Every layer reads a hub tensor made from the embeddings, and the embeddings
// also skip to the head, across every stage boundary.
struct SkipAndHubImpl : torch::nn::Module {
  SkipAndHubImpl() {
    embed = register_module("embed", torch::nn::Embedding(32, 16));
    for (int i = 0; i < 4; ++i) {
      layers.push_back(register_module("layer" + std::to_string(i), torch::nn::Linear(16, 16)));
    }
    head = register_module("head", torch::nn::Linear(16, 32));
  }
  torch::Tensor forward(const torch::Tensor& tokens, const torch::Tensor& targets) {
    auto x0 = embed(tokens);
    auto hub = torch::sigmoid(x0.mean(-1, /*keepdim=*/true));
    auto h = x0;
    for (auto& layer : layers) h = torch::tanh(layer(h)) * hub;
    auto logits = head(h + x0);
    return torch::nn::functional::cross_entropy(logits.reshape({-1, 32}), targets.reshape({-1}));
  }
  torch::nn::Embedding embed{nullptr};
  std::vector<torch::nn::Linear> layers;
  torch::nn::Linear head{nullptr};
};

TEST(GraphSplitHubTest, SkipConnectionsAndHubTensorsCrossSeveralStages) {
  torch::manual_seed(5);
  SkipAndHubImpl split_model;
  SkipAndHubImpl whole_model;
  {
    torch::NoGradGuard no_grad;  // same weights in both copies
    for (auto& item : whole_model.named_parameters()) {
      item.value().copy_(split_model.named_parameters()[item.key()]);
    }
  }
  {
    auto tokens = torch::randint(32, {2, 8}, torch::kLong);
    auto targets = torch::randint(32, {2, 8}, torch::kLong);
    auto graph = ModelGraph::Trace(split_model, {tokens, targets}, [&](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{split_model.forward(in[0], in[1])};
    });
    ASSERT_TRUE(graph.ok()) << graph.status();
    GraphPartitionOptions options;
    options.shard_count = 6;
    options.num_stages = 4;
    options.partition_method = "parameters";
    auto plan = PlanGraphStages(**graph, options);
    ASSERT_TRUE(plan.ok()) << plan.status();
    auto stages = (*graph)->Split({plan->boundaries().begin(), plan->boundaries().end()});
    ASSERT_TRUE(stages.ok()) << stages.status();
    // The last stage receives the embeddings (the skip) from the first stage,
    // and the plan describes that flow, along with the hub read by every stage.
    EXPECT_GE(stages->back()->received().size(), 2u);
    bool skip_from_first_to_last = false;
    for (const StageTensorFlow& flow : plan->flows()) {
      if (flow.from_stage() == 0 && flow.to_stages_size() >= 2 && flow.to_stages(flow.to_stages_size() - 1) == 3) {
        skip_from_first_to_last = true;
        EXPECT_EQ(flow.dtype(), "Float");
      }
      EXPECT_TRUE(std::find(stages->at(flow.from_stage())->sent().begin(), stages->at(flow.from_stage())->sent().end(),
                            flow.value_id()) != stages->at(flow.from_stage())->sent().end());
    }
    EXPECT_TRUE(skip_from_first_to_last) << plan->DebugString();
    at::Tensor loss = RunStages(**graph, *stages, {tokens, targets});
    at::Tensor reference = whole_model.forward(tokens, targets);
    reference.backward();
    EXPECT_NEAR(loss.item<double>(), reference.item<double>(), 1e-6);
    ExpectSameGradients(split_model, whole_model);
  }
}

TEST(GraphSplitShardsTest, EmbeddingsGetShardsOfTheirOwn) {
  testing::TinyModelOptions config;
  config.n_layer = 4;
  config.tie_embeddings = true;
  auto model = std::make_shared<testing::TinyModel>(config, 1);
  auto tokens = torch::randint(config.vocab_size, {1, 8}, torch::kLong);
  auto graph = ModelGraph::Trace(*model, {tokens, tokens}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model->Loss(in[0], in[1])};
  });
  ASSERT_TRUE(graph.ok());
  auto shards = SplitIntoShards(**graph, "farthest_min_deps", 2 * 4 + 4);
  ASSERT_TRUE(shards.ok());
  const auto& nodes = (*graph)->nodes();
  for (size_t s = 0; s + 1 < shards->size(); ++s) {
    int embeddings = 0, other_parameter_nodes = 0;
    for (int64_t i = (*shards)[s]; i < (*shards)[s + 1]; ++i) {
      if (nodes[i].kind == "aten::embedding")
        ++embeddings;
      else if (!nodes[i].parameters.empty())
        ++other_parameter_nodes;
    }
    if (embeddings > 0) {
      EXPECT_EQ(other_parameter_nodes, 0) << "shard " << s;
    }
  }
  EXPECT_GE(shards->size(), 8u);
}

TEST(GraphSplitErrorsTest, UnknownSplitMethodAndBadBoundaries) {
  SkipAndHubImpl model;
  auto tokens = torch::randint(32, {2, 8}, torch::kLong);
  auto graph = ModelGraph::Trace(model, {tokens, tokens}, [&](const std::vector<at::Tensor>& in) {
    return std::vector<at::Tensor>{model.forward(in[0], in[1])};
  });
  ASSERT_TRUE(graph.ok());
  EXPECT_THAT(std::string(SplitIntoShards(**graph, "random", 4).status().message()),
              HasSubstr("unknown split_method 'random'"));
  EXPECT_THAT(std::string((*graph)->Split({0, 2, 1}).status().message()), HasSubstr("must rise from 0"));
}

}  // namespace
}  // namespace trident

namespace trident {
namespace {

// A model whose forward branches on a tensor's value: tracing is refused, and
// the same model declared as a LayerSequence is partitioned at its layers.
class BranchingLayers : public torch::nn::Module, public LayerSequence {
 public:
  BranchingLayers() {
    for (int i = 0; i < 4; ++i) {
      layers_.push_back(register_module("layer" + std::to_string(i), torch::nn::Linear(8, 8)));
    }
  }
  int64_t NumLayers() const override { return 4; }
  std::string LayerName(int64_t i) const override { return "layer" + std::to_string(i); }
  at::Tensor ForwardLayer(int64_t i, const at::Tensor& x) {
    auto y = layers_[i](x);
    return y.sum().item<float>() > 0 ? torch::relu(y) : torch::tanh(y);
  }
  Values ForwardLayer(int64_t i, const Values& inputs, const Batch& batch) override {
    return {ForwardLayer(i, i == 0 ? batch.at(0) : inputs.at(0))};
  }
  NamedTensors LayerParameters(int64_t i) override {
    return {{LayerName(i) + ".weight", layers_[i]->weight}, {LayerName(i) + ".bias", layers_[i]->bias}};
  }
  at::Tensor Loss(const Values& outputs, const Batch&) override { return outputs.at(0).pow(2).mean(); }
  at::Tensor Forward(at::Tensor x) {
    for (int64_t i = 0; i < NumLayers(); ++i) x = ForwardLayer(i, x);
    return x;
  }
  // Which branch each layer takes on input `x`.
  std::vector<bool> Branches(at::Tensor x) {
    torch::NoGradGuard no_grad;
    std::vector<bool> taken;
    for (int64_t i = 0; i < NumLayers(); ++i) {
      taken.push_back(layers_[i](x).sum().item<float>() > 0);
      x = ForwardLayer(i, x);
    }
    return taken;
  }

 private:
  std::vector<torch::nn::Linear> layers_;
};

TEST(UntraceableModelTest, RefusedByTheTracerPartitionedAsALayerSequence) {
  torch::manual_seed(0);
  BranchingLayers model;
  auto forward = [&](const std::vector<at::Tensor>& in) { return std::vector<at::Tensor>{model.Forward(in[0])}; };
  auto x = torch::randn({3, 8});
  // Look for an input that takes another branch somewhere.
  std::vector<at::Tensor> check;
  for (int attempt = 0; attempt < 200 && check.empty(); ++attempt) {
    auto candidate = torch::randn({3, 8}) * 4;
    if (model.Branches(candidate) != model.Branches(x)) check = {candidate};
  }
  ASSERT_FALSE(check.empty());
  auto traced = ModelGraph::Trace(model, {x}, forward, check);
  ASSERT_FALSE(traced.ok());
  EXPECT_THAT(std::string(traced.status().message()), HasSubstr("Declare the model as a LayerSequence"));

  auto profile = ProfileLayers(model, {x});
  ASSERT_TRUE(profile.ok()) << profile.status();
  PartitionOptions options;
  options.num_stages = 2;
  options.partition_method = "uniform";
  auto plan = PlanStages(*profile, options);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->stages(1).layer_names(0), "layer2");
}

}  // namespace
}  // namespace trident
