// Each operator and layer on 2 and 4 ranks against the single-process
// computation, forward and backward.
#include "tensor_parallel/tensor_parallel.h"

#include <c10/core/GradMode.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "graph/model_graph.h"
#include "testing/multiprocess.h"
#include "topology/topology.h"

namespace trident {
namespace {

using ::testing::HasSubstr;

// Equal to rounding: the largest difference within 1e-5 of the largest magnitude.
void ExpectClose(const at::Tensor& actual, const at::Tensor& expected, const std::string& what) {
  ASSERT_TRUE(actual.defined()) << what;
  ASSERT_EQ(actual.sizes(), expected.sizes()) << what;
  const double diff = (actual - expected).abs().max().item<double>();
  const double scale = std::max(1.0, expected.abs().max().item<double>());
  EXPECT_LE(diff, 1e-5 * scale) << what << ": max diff " << diff << " of " << scale;
}

// The same random tensor on every rank.
at::Tensor Shared(std::vector<int64_t> shape, uint64_t seed) {
  auto generator = at::make_generator<at::CPUGeneratorImpl>(seed);
  return at::randn(shape, generator);
}

class TensorParallelOpsTest : public ::testing::TestWithParam<int> {};

TEST_P(TensorParallelOpsTest, ForwardAndBackwardEqualOneProcess) {
  const int p = GetParam();
  testing::RunOnRanks(p, [p](int r) {
    auto topology = testing::JoinTopology({{"tensor", p}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const std::string g = "tp";
    // Rank-specific tensors are slices of tensors every rank can build.
    const at::Tensor X = Shared({2, 4, 8}, 1), W = Shared({2, 4, 8}, 2);
    const at::Tensor per_rank = Shared({p, 2, 4, 8}, 3);  // per_rank[r]: rank r's own tensor

    {  // copy_to: identity; gradient summed over ranks.
      at::Tensor x = X.clone().requires_grad_(true);
      at::Tensor y = CopyToTensorParallelRegion(x, g);
      ExpectClose(y, X, "copy_to forward");
      (y * per_rank[r]).sum().backward();
      ExpectClose(x.grad(), per_rank.sum(0), "copy_to backward");
    }
    {  // reduce_from: sum over ranks; gradient passed through.
      at::Tensor x = per_rank[r].clone().requires_grad_(true);
      at::Tensor y = ReduceFromTensorParallelRegion(x, g);
      ExpectClose(y, per_rank.sum(0), "reduce_from forward");
      (y * W).sum().backward();
      ExpectClose(x.grad(), W, "reduce_from backward");
    }
    {  // gather along the last dimension; gradient sliced.
      at::Tensor x = X.chunk(p, -1)[r].clone().requires_grad_(true);
      at::Tensor y = GatherFromTensorParallelRegion(x, g);
      ExpectClose(y, X, "gather forward");
      (y * W).sum().backward();
      ExpectClose(x.grad(), W.chunk(p, -1)[r], "gather backward");
    }
    {  // scatter: own slice of the last dimension; gradient gathered.
      at::Tensor x = X.clone().requires_grad_(true);
      at::Tensor y = ScatterToTensorParallelRegion(x, g);
      ExpectClose(y, X.chunk(p, -1)[r], "scatter forward");
      (y * W.chunk(p, -1)[r]).sum().backward();
      ExpectClose(x.grad(), W, "scatter backward");
    }
    {  // sequence gather along dim 1; gradient reduce-scattered.
      at::Tensor x = X.chunk(p, 1)[r].clone().requires_grad_(true);
      at::Tensor y = GatherFromSequenceParallelRegion(x, g, 1);
      ExpectClose(y, X, "sequence gather forward");
      (y * per_rank[r]).sum().backward();
      ExpectClose(x.grad(), per_rank.sum(0).chunk(p, 1)[r], "sequence gather backward");
    }
    {  // reduce-scatter along dim 1; gradient all-gathered.
      at::Tensor x = per_rank[r].clone().requires_grad_(true);
      at::Tensor y = ReduceScatterToSequenceParallelRegion(x, g, 1);
      ExpectClose(y, per_rank.sum(0).chunk(p, 1)[r], "reduce-scatter forward");
      (y * W.chunk(p, 1)[r]).sum().backward();
      ExpectClose(x.grad(), W, "reduce-scatter backward");
    }
    {  // vocabulary-parallel cross-entropy: losses and logit gradients.
      const at::Tensor logits = Shared({6, 16}, 4) * 3;
      const at::Tensor targets = at::tensor({0, 5, 15, 8, 3, 12}, at::kLong);
      at::Tensor full = logits.clone().requires_grad_(true);
      at::Tensor expected = at::cross_entropy_loss(full, targets, {}, at::Reduction::None);
      (expected * at::arange(6)).sum().backward();
      at::Tensor local = logits.chunk(p, 1)[r].clone().requires_grad_(true);
      at::Tensor loss = VocabParallelCrossEntropy(local, targets, g);
      ExpectClose(loss, expected.detach(), "cross-entropy forward");
      (loss * at::arange(6)).sum().backward();
      ExpectClose(local.grad(), full.grad().chunk(p, 1)[r], "cross-entropy backward");
      // bf16 logits: the losses come back in fp32, those of the logits' values.
      const at::Tensor rounded = logits.to(at::kBFloat16);
      at::Tensor half_loss = VocabParallelCrossEntropy(rounded.chunk(p, 1)[r], targets, g);
      EXPECT_EQ(half_loss.scalar_type(), at::kFloat);
      ExpectClose(half_loss, at::cross_entropy_loss(rounded.to(at::kFloat), targets, {}, at::Reduction::None),
                  "cross-entropy of bf16 logits");
    }
    EXPECT_GT(TensorParallelBytesCommunicated(), 0);
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, TensorParallelOpsTest, ::testing::Values(2, 4));

// A column-then-row MLP and a vocabulary-parallel embedding built from slices
// of full weights compute the full layers' outputs and weight gradients, with
// and without sequence parallelism, and sub-pipelined (tp_overlapping_level 1).
class TensorParallelLayersTest : public ::testing::TestWithParam<std::tuple<int, bool, int>> {};

int64_t AllReducesIssued() {
  const auto times = CommunicationTimes();
  const auto found = times.find("all_reduce");
  return found == times.end() ? 0 : found->second.operations;
}

TEST_P(TensorParallelLayersTest, LayersEqualTheirUnshardedForm) {
  const auto [p, sequence_parallel, overlapping_level] = GetParam();
  testing::RunOnRanks(p, [p = p, sp = sequence_parallel, level = overlapping_level](int r) {
    auto topology = testing::JoinTopology({{"tensor", p}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const TensorParallelism tp{p, r, "tp", sp, /*parallel_vocab=*/true, level};
    const int64_t C = 8, H = 16, V = 12;
    const at::Tensor W1 = Shared({3 * H, C}, 5), b1 = Shared({3 * H}, 6);
    const at::Tensor W2 = Shared({C, 3 * H}, 7), b2 = Shared({C}, 8), E = Shared({V, C}, 9);
    const at::Tensor X = Shared({2, 4, C}, 10), ids = at::tensor({0, 3, 7, 11, 5, 6, 1, 9}, at::kLong).view({2, 4});

    // Reference: the unsharded computation.
    std::vector<at::Tensor> full = {W1.clone(), b1.clone(), W2.clone(), b2.clone(), E.clone()};
    for (auto& t : full) t.requires_grad_(true);
    at::Tensor x_full = X.clone().requires_grad_(true);
    at::Tensor expected =
        at::linear(at::gelu(at::linear(x_full, full[0], full[1])), full[2], full[3]) + at::embedding(full[4], ids);
    (expected * expected).sum().backward();

    // Column with 3 blocks (a fused q, k, v layout), so the row layer's input
    // features are this rank's slice of each block too; vocab-parallel embedding.
    ColumnParallelLinear column(tp, C, 3 * H, true, false, /*blocks=*/3);
    RowParallelLinear row(tp, 3 * H, C);
    const ShardSpec row_spec{1, p, r, 3};
    VocabParallelEmbedding embedding(tp, V, C);
    {
      c10::NoGradGuard no_grad;
      column->weight.copy_(column->weight_shard().Slice(W1));
      column->bias.copy_(column->weight_shard().Slice(b1));
      row->weight.copy_(row_spec.Slice(W2));
      row->bias.copy_(b2);
      embedding->weight.copy_(embedding->weight_shard().Slice(E));
    }
    at::Tensor x = (sp ? X.chunk(p, 1)[r] : X).clone().requires_grad_(true);
    const int64_t all_reduces_before = AllReducesIssued();
    at::Tensor y = row->forward(at::gelu(column->forward(x))) + embedding->forward(ids);
    const at::Tensor mine = sp ? expected.detach().chunk(p, 1)[r] : expected.detach();
    ExpectClose(y, mine, "output");
    // With sequence parallelism each rank's loss covers its shard, and the
    // losses sum to the reference; without, every rank's loss is the reference.
    (y * y).sum().backward();
    if (!sp) {
      // The column layer's input gradient and the row layer's output: one
      // all-reduce each, or one per block of 4 rows when sub-pipelined; and
      // the embedding's.
      EXPECT_EQ(AllReducesIssued() - all_reduces_before, level == 1 ? 2 * 2 + 1 : 1 + 1 + 1);
    }
    if (sp) {
      ASSERT_TRUE(SequenceParallelGradients({row->bias}, "tp").ok());
    }
    ExpectClose(column->weight.grad(), column->weight_shard().Slice(full[0].grad()), "column weight");
    ExpectClose(column->bias.grad(), column->weight_shard().Slice(full[1].grad()), "column bias");
    ExpectClose(row->weight.grad(), row_spec.Slice(full[2].grad()), "row weight");
    ExpectClose(row->bias.grad(), full[3].grad(), "row bias");
    ExpectClose(embedding->weight.grad(), embedding->weight_shard().Slice(full[4].grad()), "embedding");
    ExpectClose(x.grad(), sp ? x_full.grad().chunk(p, 1)[r] : x_full.grad(), "input");
  });
}

INSTANTIATE_TEST_SUITE_P(RanksSequenceParallelAndSubPipelining, TensorParallelLayersTest,
                         ::testing::Values(std::make_tuple(2, false, 0), std::make_tuple(2, true, 0),
                                           std::make_tuple(2, false, 1), std::make_tuple(4, false, 0),
                                           std::make_tuple(4, true, 0), std::make_tuple(4, false, 1)));

// A pre-norm block of two regions (norm, column, GELU, row, residual add) run
// sub-pipelined (tp_overlapping_level 2) computes the unsharded block's output
// and gradients; backward overlaps every input-gradient sum but the last with
// the next half's products.
class SubPipelinedBlockTest : public ::testing::TestWithParam<int> {};

TEST_P(SubPipelinedBlockTest, EqualsTheUnshardedBlockAndOverlapsBackwardSums) {
  const int p = GetParam();
  testing::RunOnRanks(p, [p](int r) {
    auto topology = testing::JoinTopology({{"tensor", p}});
    ASSERT_TRUE(topology.ok()) << topology.status();
    const TensorParallelism tp{p, r, "tp", false, /*parallel_vocab=*/true, /*overlapping_level=*/2};
    const int64_t C = 8, H = 16, regions = 2;
    const at::Tensor X = Shared({3, 4, C}, 20);  // an odd batch: halves of 2 and 1
    std::vector<at::Tensor> full;                // per region: norm scale, W1, b1, W2, b2
    for (int64_t i = 0; i < regions; ++i) {
      for (auto shape : std::vector<std::vector<int64_t>>{{C}, {H, C}, {H}, {C, H}, {C}}) {
        full.push_back(Shared(shape, 21 + full.size()).requires_grad_(true));
      }
    }
    auto norm = [C](const at::Tensor& x, const at::Tensor& scale) { return at::layer_norm(x, {C}, scale); };
    at::Tensor x_full = X.clone().requires_grad_(true), expected = x_full;
    for (int64_t i = 0; i < regions; ++i) {
      const at::Tensor* w = &full[5 * i];
      expected = expected + at::linear(at::gelu(at::linear(norm(expected, w[0]), w[1], w[2])), w[3], w[4]);
    }
    (expected * expected).sum().backward();

    std::vector<at::Tensor> scales;
    std::vector<ColumnParallelLinear> columns;
    std::vector<RowParallelLinear> rows;
    std::vector<BlockRegion> block;
    for (int64_t i = 0; i < regions; ++i) {
      const at::Tensor* w = &full[5 * i];
      scales.push_back(w[0].detach().clone().requires_grad_(true));
      columns.emplace_back(tp, C, H);
      rows.emplace_back(tp, H, C);
      {
        c10::NoGradGuard no_grad;
        columns[i]->weight.copy_(columns[i]->weight_shard().Slice(w[1]));
        columns[i]->bias.copy_(columns[i]->weight_shard().Slice(w[2]));
        rows[i]->weight.copy_(rows[i]->weight_shard().Slice(w[3]));
        rows[i]->bias.copy_(w[4]);
      }
      block.push_back(
          {[&, i](const at::Tensor& x) { return norm(x, scales[i]); },
           [&, i](const at::Tensor& h) { return rows[i]->PartialForward(at::gelu(columns[i]->ForwardInRegion(h))); },
           [&, i](const at::Tensor& x, const at::Tensor& y) { return x + y + rows[i]->bias; }});
    }
    ASSERT_TRUE(SubPipelinesBlock(tp, X));
    at::Tensor x = X.clone().requires_grad_(true);
    const int64_t all_reduces_before = AllReducesIssued(), overlapped_before = SubPipelinedGradientSumsOverlapped();
    at::Tensor y = RunSubPipelinedBlock(x, block, tp.group);
    ExpectClose(y, expected.detach(), "output");
    (y * y).sum().backward();
    // Per half and region, one sum of the output forward and one of the input's gradient backward.
    EXPECT_EQ(AllReducesIssued() - all_reduces_before, 2 * 2 * regions);
    // Backward starts the sums in the order: second half, first half of the
    // last region, then of the first; each but the last is awaited after the next starts.
    EXPECT_EQ(SubPipelinedGradientSumsOverlapped() - overlapped_before, 2 * regions - 1);
    ExpectClose(x.grad(), x_full.grad(), "input");
    for (int64_t i = 0; i < regions; ++i) {
      const at::Tensor* w = &full[5 * i];
      const std::string region = "region " + std::to_string(i) + " ";
      ExpectClose(scales[i].grad(), w[0].grad(), region + "norm scale");
      ExpectClose(columns[i]->weight.grad(), columns[i]->weight_shard().Slice(w[1].grad()), region + "column weight");
      ExpectClose(columns[i]->bias.grad(), columns[i]->weight_shard().Slice(w[2].grad()), region + "column bias");
      ExpectClose(rows[i]->weight.grad(), rows[i]->weight_shard().Slice(w[3].grad()), region + "row weight");
      ExpectClose(rows[i]->bias.grad(), w[4].grad(), region + "row bias");
    }
    // Without gradients (evaluation) the block runs forward only, no gradient sums.
    c10::NoGradGuard no_grad;
    ExpectClose(RunSubPipelinedBlock(X, block, tp.group), expected.detach(), "output without gradients");
  });
}

INSTANTIATE_TEST_SUITE_P(Ranks, SubPipelinedBlockTest, ::testing::Values(2, 4));

TEST(SubPipelinedBlockTest, AppliesFromLevelTwoToBatchesOfTwo) {
  const at::Tensor batch = at::zeros({2, 4, 8}), one = at::zeros({1, 4, 8});
  EXPECT_TRUE(SubPipelinesBlock({2, 0, "tp", false, true, 2}, batch));
  EXPECT_FALSE(SubPipelinesBlock({2, 0, "tp", false, true, 2}, one));
  EXPECT_FALSE(SubPipelinesBlock({2, 0, "tp", false, true, 1}, batch));
  EXPECT_FALSE(SubPipelinesBlock({1, 0, "tp", false, true, 2}, batch));
  EXPECT_FALSE(SubPipelinesBlock({2, 0, "tp", true, true, 2}, batch));
}

TEST(ShardSpecTest, SliceAndUnsliceRoundTripWithBlocks) {
  const at::Tensor full = at::arange(24).view({12, 2});
  std::vector<at::Tensor> shards;
  for (int r = 0; r < 2; ++r) shards.push_back(ShardSpec{0, 2, r, 3}.Slice(full));
  // Rank 0 holds rows 0-1, 4-5, 8-9 (the first half of each of the 3 blocks).
  EXPECT_TRUE(at::equal(shards[0].select(1, 0), at::tensor({0, 2, 8, 10, 16, 18})));
  EXPECT_TRUE(at::equal(ShardSpec{0, 2, 0, 3}.Unslice(shards), full));
  const ShardSpec halves{0, 2, 0, 3};
  EXPECT_EQ(*halves.ShardShape({12, 2}), (std::vector<int64_t>{6, 2}));
  EXPECT_THAT(std::string(ShardSpec{0, 8, 0, 3}.ShardShape({12, 2}).status().message()),
              HasSubstr("cannot be split into 8 parts along dimension 0 (in 3 blocks)"));
}

TEST(TensorParallelLayersErrorTest, DimensionsThatDoNotDivideAreNamed) {
  const TensorParallelism tp{4, 0, "tp"};
  EXPECT_THROW(
      {
        try {
          VocabParallelEmbedding(tp, 10, 8);
        } catch (const std::invalid_argument& e) {
          EXPECT_THAT(e.what(), HasSubstr("vocab_size (10) is not divisible by tp (4)"));
          throw;
        }
      },
      std::invalid_argument);
  EXPECT_THROW(RowParallelLinear(tp, 6, 8), std::invalid_argument);
}

// A user model opts in by building ParallelLinear layers and naming them; the
// traced graph keeps the collectives as single operator nodes.
struct UserBlockImpl : torch::nn::Module {
  UserBlockImpl() {
    up = register_module("up", ParallelLinear(8, 32));
    down = register_module("down", ParallelLinear(32, 8));
    heads = register_buffer("heads", at::tensor(4, at::kLong));
  }
  at::Tensor forward(const at::Tensor& x) {
    at::Tensor h = at::relu(up->forward(x));
    // Reads its head count, which tensor parallelism divides.
    h = h.view({x.size(0), heads.item<int64_t>(), -1}).softmax(-1).flatten(1);
    return down->forward(h);
  }
  ParallelLinear up{nullptr}, down{nullptr};
  at::Tensor heads;
};
TORCH_MODULE(UserBlock);

TEST(ApplyTensorParallelTest, NamedLayersShardAUserModel) {
  testing::RunOnRanks(2, [](int r) {
    auto topology = testing::JoinTopology({{"tensor", 2}});
    ASSERT_TRUE(topology.ok());
    torch::manual_seed(3);
    UserBlock whole;
    torch::manual_seed(3);
    UserBlock sharded;
    const at::Tensor x = Shared({5, 8}, 11);
    at::Tensor expected = whole->forward(x);
    expected.sum().backward();
    ASSERT_TRUE(ApplyTensorParallel(*sharded, {{"up"}, {"down"}, {"heads"}}, {2, r, "tp"}).ok());
    EXPECT_EQ(sharded->heads.item<int64_t>(), 2);
    EXPECT_EQ(sharded->up->weight.size(0), 16);
    at::Tensor y = sharded->forward(x);
    ExpectClose(y, expected.detach(), "output");
    y.sum().backward();
    ExpectClose(sharded->up->weight.grad(), whole->up->weight.grad().chunk(2, 0)[r], "up");
    ExpectClose(sharded->down->weight.grad(), whole->down->weight.grad().chunk(2, 1)[r], "down");

    auto graph = ModelGraph::Trace(*sharded, {x}, [&](const std::vector<at::Tensor>& in) {
      return std::vector<at::Tensor>{sharded->forward(in[0])};
    });
    ASSERT_TRUE(graph.ok()) << graph.status();
    std::vector<std::string> kinds;
    for (const auto& node : (*graph)->nodes()) kinds.push_back(node.kind);
    EXPECT_THAT(kinds, ::testing::Contains("trident::copy_to_tp_region"));
    EXPECT_THAT(kinds, ::testing::Contains("trident::reduce_from_tp_region"));

    UserBlock other;
    EXPECT_THAT(std::string(ApplyTensorParallel(*other, {{"upp"}, {}, {}}, {2, r, "tp"}).message()),
                HasSubstr("column layer 'upp' matches no ParallelLinear module"));
    EXPECT_THAT(std::string(ApplyTensorParallel(*other, {{}, {}, {"heads"}}, {8, r, "tp"}).message()),
                HasSubstr("attribute 'heads' (4) is not divisible by tp (8)"));
  });
}

}  // namespace
}  // namespace trident
