// Parity of every layout with one process, gradient accumulation, mixed
// precision, sampling, export / init_from and hooks (resume: resume_test.cc).
#include "trainer/trainer.h"

#include <cmath>
#include <cstdlib>
#include <fstream>
#include <functional>
#include <limits>
#include <map>
#include <numeric>
#include <sstream>
#include <tuple>

#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "data/data.h"
#include "testing/multiprocess.h"
#include "trainer/internal/training_runs.h"

namespace trident {
namespace {

using testing::DataDir;
using testing::ExpectSameLosses;
using ::testing::HasSubstr;
using testing::SetFlag;
using testing::SmallConfig;
using testing::TestDir;
using testing::TrainEverywhere;
using testing::TrainOnRanks;

TEST(TrainerParityTest, DataParallelLossesEqualOneProcess) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "dp1");
  ASSERT_EQ(single.size(), 20u);
  EXPECT_LT(single.back(), single.front() * 0.8) << "the model should learn";
  for (int dp : {2, 4}) {
    SCOPED_TRACE("dp=" + std::to_string(dp));
    ExpectSameLosses(single, TrainOnRanks(SmallConfig(dp), "dp" + std::to_string(dp)), 1e-5);
  }
}

// Pipeline parallelism: every schedule, pp = 2 and 4, dp x pp = 2 x 2, with and
// without (stage-aware) recomputation, trains the losses of one process on the
// same global batch.
TEST(TrainerParityTest, PipelineLossesEqualOneProcess) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "pp_reference");
  struct Layout {
    int dp, pp;
    const char* schedule;
    const char* checkpointing = "none";
    int virtual_stages = 1;
    const char* split_points = "";
  };
  for (const Layout& layout :
       {Layout{1, 2, "gpipe"}, Layout{1, 2, "1f1b"}, Layout{1, 4, "1f1b"}, Layout{2, 2, "1f1b"},
        Layout{1, 2, "1f1b", "full"}, Layout{1, 4, "gpipe", "stage_aware"},
        Layout{1, 2, "last_no_recompute_1f1b", "full"}, Layout{1, 2, "pre_recompute_1f1b", "full"},
        Layout{1, 1, "1f1b", "full"}, Layout{1, 4, "shifted_critical_path", "stage_aware"}, Layout{1, 2, "zb_h1"},
        Layout{1, 4, "zb_h1", "full"}, Layout{1, 2, "interleaved_1f1b", "none", 2},
        Layout{2, 2, "interleaved_1f1b", "stage_aware", 2}, Layout{1, 2, "1f1b", "none", 1, "transformer.h.0"}}) {
    TrainerConfig config = SmallConfig(layout.dp);
    config.mutable_plan()->set_pp(layout.pp);
    config.mutable_plan()->mutable_pipeline()->set_schedule(layout.schedule);
    config.mutable_plan()->set_virtual_stages(layout.virtual_stages);
    SetFlag(&config, "custom_split_points", layout.split_points);
    config.mutable_plan()->set_micro_batch_size(2);
    SetFlag(&config, "activation_checkpointing", layout.checkpointing);
    const std::string tag = absl::StrCat("dp", layout.dp, "_pp", layout.pp, "x", layout.virtual_stages, "_",
                                         layout.schedule, "_", layout.checkpointing, "_", layout.split_points);
    SCOPED_TRACE(tag);
    ExpectSameLosses(single, TrainOnRanks(config, tag), 1e-5);
  }
}

// Tensor parallelism (and sequence parallelism) for gpt and llama, and the 3D
// layout dp x tp x pp = 2 x 2 x 2 on 8 ranks, train the losses of one process.
// checkpoint_modules: recomputed attention and MLP blocks train the losses of
// the same layout without recomputation, dropout masks included (pipeline
// stages draw their own masks, so each layout against itself). Modules and
// selected layers that match nothing are refused.
TEST(TrainerParityTest, RecomputedModulesTrainTheSameLosses) {
  for (int pp : {1, 2}) {
    TrainerConfig config = SmallConfig(1);
    SetFlag(&config, "dropout", 0.1);
    config.mutable_plan()->set_micro_batch_size(2);
    config.mutable_plan()->set_pp(pp);
    SCOPED_TRACE(absl::StrCat("pp=", pp));
    const std::vector<double> reference = TrainOnRanks(config, absl::StrCat("recompute_reference_pp", pp));
    SetFlag(&config, "checkpoint_modules", pp == 1 ? "attn,mlp" : "CausalSelfAttention,Mlp");  // by name, by class
    ExpectSameLosses(reference, TrainOnRanks(config, absl::StrCat("recompute_pp", pp)), 1e-6);
  }
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    for (const auto& [modules, message] : std::vector<std::pair<std::string, std::string>>{
             {"ln_1", "module 'transformer.h.0.ln_1' (torch::nn::LayerNormImpl) cannot recompute its forward"},
             {"attn,atn", "checkpoint_modules: entry 'atn' matches no module of the model"}}) {
      TrainerConfig config = SmallConfig(1);
      SetFlag(&config, "checkpoint_modules", modules);
      auto refused = Trainer::Create(config, topology->get());
      ASSERT_FALSE(refused.ok()) << modules;
      EXPECT_THAT(std::string(refused.status().message()), HasSubstr(message));
    }
    TrainerConfig config = SmallConfig(1);
    SetFlag(&config, "activation_checkpointing", "selected");
    SetFlag(&config, "checkpoint_layers", "transformer.h.9");
    auto refused = Trainer::Create(config, topology->get());
    ASSERT_FALSE(refused.ok());
    EXPECT_THAT(std::string(refused.status().message()),
                HasSubstr("checkpoint_layers: entry 'transformer.h.9' matches no layer of the model (layer names "
                          "are like 'transformer.h.0')"));
  });
}

// module_replace: gpt with every built-in pair (attention in two query
// blocks: 160 positions) and llama with fused attention train the losses of
// the original model in one process, at tp=2 with sequence parallelism, at
// pp=2, and under ZeRO-3.
TEST(TrainerParityTest, ReplacedModulesTrainTheSameLosses) {
  for (const char* model : {"gpt", "llama"}) {
    auto configure = [&](int dp, int tp, int pp) {
      TrainerConfig config = SmallConfig(dp);
      SetFlag(&config, "model", model);
      SetFlag(&config, "preset", absl::StrCat(model, "-tiny"));
      SetFlag(&config, "block_size", 160);
      config.mutable_plan()->set_tp(tp);
      config.mutable_plan()->set_pp(pp);
      config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(tp > 1);
      config.mutable_plan()->set_micro_batch_size(pp > 1 ? 2 : 8 / dp);
      return config;
    };
    const std::vector<double> reference = TrainOnRanks(configure(1, 1, 1), absl::StrCat("replace_reference_", model));
    for (auto [dp, tp, pp] : std::vector<std::tuple<int, int, int>>{{1, 1, 1}, {1, 2, 1}, {1, 1, 2}, {2, 1, 1}}) {
      TrainerConfig config = configure(dp, tp, pp);
      // The loss's pair where the vocabulary is whole (tp splits it here).
      SetFlag(&config, "module_replace",
              absl::StrCat(
                  std::string(model) == "gpt" ? "fused_attention,fused_layer_norm,fused_bias_gelu" : "fused_attention",
                  tp == 1 ? ",fused_cross_entropy" : ""));
      if (dp > 1) config.mutable_plan()->mutable_zero()->set_stage(3);
      const std::string tag = absl::StrCat("replace_", model, "_dp", dp, "_tp", tp, "_pp", pp);
      SCOPED_TRACE(tag);
      ExpectSameLosses(reference, TrainOnRanks(config, tag), 1e-5);
    }
  }
  testing::RunOnRanks(1, [](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    struct Refused {
      const char* model;
      double dropout;
      const char* pairs;
      const char* message;
    };
    for (const Refused& r :
         {Refused{"llama", 0, "fused_layer_norm",
                  "module_replace: entry 'fused_layer_norm' matches no module of the model"},
          Refused{"gpt", 0.1, "fused_attention",
                  "module_replace: entry 'fused_attention' matches no module of the model"},
          Refused{"gpt", 0, "fused_atention", "unknown replacement pair (module_replace) 'fused_atention'"}}) {
      TrainerConfig config = SmallConfig(1);
      SetFlag(&config, "model", r.model);
      SetFlag(&config, "preset", absl::StrCat(r.model, "-tiny"));
      SetFlag(&config, "dropout", r.dropout);
      SetFlag(&config, "module_replace", r.pairs);
      auto refused = Trainer::Create(config, topology->get());
      ASSERT_FALSE(refused.ok()) << r.pairs;
      EXPECT_THAT(std::string(refused.status().message()), HasSubstr(r.message));
    }
  });
}

// dealloc_pipeoutput: stages that free what they sent train the same losses.
TEST(TrainerParityTest, DeallocatedPipelineOutputsTrainTheSameLosses) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "dealloc_reference");
  for (const char* schedule : {"gpipe", "1f1b", "zb_h1", "interleaved_1f1b", "1f1b_pp4"}) {
    TrainerConfig config = SmallConfig(1);
    config.mutable_plan()->set_pp(std::string(schedule) == "1f1b_pp4" ? 4 : 2);
    if (config.plan().pp() == 4) schedule = "1f1b";
    config.mutable_plan()->mutable_pipeline()->set_schedule(schedule);
    config.mutable_plan()->set_virtual_stages(std::string(schedule) == "interleaved_1f1b" ? 2 : 1);
    config.mutable_plan()->set_micro_batch_size(2);
    config.mutable_plan()->mutable_pipeline()->set_dealloc_pipeoutput(true);
    SCOPED_TRACE(schedule);
    ExpectSameLosses(single, TrainOnRanks(config, absl::StrCat("dealloc_", schedule, "_pp", config.plan().pp())), 1e-5);
  }
}

TEST(TrainerParityTest, TensorParallelLossesEqualOneProcess) {
  struct Layout {
    const char* model;
    int dp, tp, pp;
    bool sequence_parallel = false;
    int overlapping_level = 0;  // tp_overlapping_level: 1 sub-pipelines every parallel layer, 2 also the blocks
    bool recompute = false;     // attention and MLP recomputed in backward
  };
  std::map<std::string, std::vector<double>> single;
  for (const Layout& layout :
       {Layout{"gpt", 1, 2, 1}, Layout{"gpt", 1, 4, 1}, Layout{"gpt", 1, 2, 1, true}, Layout{"gpt", 1, 4, 1, true},
        Layout{"llama", 1, 2, 1}, Layout{"llama", 1, 4, 1}, Layout{"llama", 1, 2, 1, true},
        Layout{"llama", 1, 4, 1, true}, Layout{"gpt", 2, 2, 2, true}, Layout{"gpt", 1, 2, 1, false, 1},
        Layout{"llama", 1, 4, 1, false, 1}, Layout{"gpt", 2, 2, 2, false, 1}, Layout{"gpt", 1, 2, 1, false, 2},
        Layout{"llama", 1, 2, 1, false, 2, true}, Layout{"gpt", 2, 2, 2, false, 2, true}}) {
    auto configure = [&](int dp, int tp, int pp) {
      TrainerConfig config = SmallConfig(dp);
      SetFlag(&config, "model", layout.model);
      SetFlag(&config, "preset", std::string(layout.model) + "-tiny");
      if (std::string(layout.model) == "llama") SetFlag(&config, "n_kv_head", 4);
      config.mutable_plan()->set_tp(tp);
      config.mutable_plan()->set_pp(pp);
      config.mutable_plan()->set_micro_batch_size(2);
      config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(tp > 1 && layout.sequence_parallel);
      config.mutable_plan()->mutable_tensor_parallel()->set_overlapping_level(layout.overlapping_level);
      if (layout.recompute)
        SetFlag(&config, "checkpoint_modules", std::string(layout.model) == "llama" ? "self_attn,mlp" : "attn,mlp");
      return config;
    };
    if (!single.count(layout.model)) {
      single[layout.model] = TrainOnRanks(configure(1, 1, 1), absl::StrCat("tp_reference_", layout.model));
    }
    const std::string tag = absl::StrCat(
        layout.model, "_dp", layout.dp, "_tp", layout.tp, "_pp", layout.pp, layout.sequence_parallel ? "_sp" : "",
        layout.overlapping_level > 0 ? absl::StrCat("_overlap", layout.overlapping_level) : "",
        layout.recompute ? "_recompute" : "");
    SCOPED_TRACE(tag);
    ExpectSameLosses(single[layout.model], TrainOnRanks(configure(layout.dp, layout.tp, layout.pp), tag), 1e-5);
  }
}

// parallel_vocab false: embedding and head whole on every tensor-parallel
// rank (with sequence parallelism each rank's loss is its sequence shard's),
// for gpt (tied and untied heads) and llama, and a vocabulary tp does not
// divide (257).
TEST(TrainerParityTest, WholeVocabularyLossesEqualOneProcess) {
  struct Layout {
    const char* model;
    int tp, pp;
    bool sequence_parallel, untied = false;
    int64_t vocab_size = 256;
  };
  std::map<std::string, std::vector<double>> single;
  for (const Layout& layout :
       {Layout{"gpt", 2, 1, false}, Layout{"gpt", 2, 1, true}, Layout{"gpt", 2, 2, true},
        Layout{"gpt", 2, 1, true, true}, Layout{"llama", 2, 1, true}, Layout{"gpt", 2, 1, true, false, 257}}) {
    auto configure = [&](int tp, int pp) {
      TrainerConfig config = SmallConfig(1);
      SetFlag(&config, "model", layout.model);
      SetFlag(&config, "preset", absl::StrCat(layout.model, "-tiny"));
      config.mutable_plan()->mutable_trace()->set_no_tie_modules(layout.untied);
      SetFlag(&config, "vocab_size", layout.vocab_size);
      config.mutable_plan()->set_tp(tp);
      config.mutable_plan()->set_pp(pp);
      config.mutable_plan()->set_micro_batch_size(pp > 1 ? 2 : 8);
      config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(tp > 1 && layout.sequence_parallel);
      config.mutable_plan()->mutable_tensor_parallel()->set_parallel_vocab(false);
      return config;
    };
    const std::string model = absl::StrCat(layout.model, layout.untied ? "_untied" : "", "_v", layout.vocab_size);
    if (!single.count(model)) single[model] = TrainOnRanks(configure(1, 1), "whole_vocabulary_reference_" + model);
    const std::string tag = absl::StrCat("whole_vocabulary_", model, "_tp", layout.tp, "_pp", layout.pp,
                                         layout.sequence_parallel ? "_sp" : "");
    SCOPED_TRACE(tag);
    ExpectSameLosses(single[model], TrainOnRanks(configure(layout.tp, layout.pp), tag), 1e-5);
  }
}

// no_tie_modules: gpt's head has its own matrix, trained the same in every
// layout, and exported under lm_head.weight beside the embedding's.
TEST(TrainerParityTest, UntiedHeadLossesEqualOneProcess) {
  auto untied = [](int dp, int tp, int pp, bool sequence_parallel) {
    TrainerConfig config = SmallConfig(dp);
    config.mutable_plan()->mutable_trace()->set_no_tie_modules(true);
    config.mutable_plan()->set_tp(tp);
    config.mutable_plan()->set_pp(pp);
    config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(sequence_parallel);
    config.mutable_plan()->set_micro_batch_size(pp > 1 ? 2 : 8 / dp);
    return config;
  };
  const std::vector<double> single = TrainOnRanks(untied(1, 1, 1, false), "untied_single");
  EXPECT_NE(single.back(), TrainOnRanks(SmallConfig(1), "tied_single").back()) << "the head is another matrix";
  const std::string exported = TestDir() + "/untied/model.safetensors";
  TrainerConfig pipeline = untied(1, 1, 2, false);
  pipeline.mutable_checkpoint()->set_export_safetensors(exported);
  ExpectSameLosses(single, TrainOnRanks(pipeline, "untied_pp2"), 1e-5);
  ExpectSameLosses(single, TrainOnRanks(untied(1, 2, 1, true), "untied_tp2_sp"), 1e-5);
  ExpectSameLosses(single, TrainOnRanks(untied(2, 2, 1, false), "untied_dp2_tp2"), 1e-5);
  auto contents = ReadSafetensors(exported);
  ASSERT_TRUE(contents.ok()) << contents.status();
  auto head = contents->Get("lm_head.weight");
  auto wte = contents->Get("transformer.wte.weight");
  ASSERT_TRUE(head.ok() && wte.ok());
  EXPECT_EQ(head->sizes(), wte->sizes());
  EXPECT_FALSE(at::equal(*head, *wte));
}

// ATorch's parallel_mode order and rank order: the ranks placed otherwise on
// the mesh train the losses of one process and export the weights of the
// usual order, bit for bit (the export gathers at the mesh's origin, here not
// rank 0).
TEST(TrainerParityTest, AxisAndRankOrderKeepParity) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "order_single");
  struct Layout {
    int dp, tp, pp;
    const char* axis_order;
    const char* rank_order;
  };
  for (const Layout& layout :
       {Layout{2, 1, 2, "data,pipeline,tensor", "3,1,2,0"}, Layout{2, 2, 1, "data,tensor,pipeline", "1,0,3,2"}}) {
    SCOPED_TRACE(layout.axis_order);
    auto config = [&](const char* axis_order, const char* rank_order, const std::string& path) {
      TrainerConfig c = SmallConfig(layout.dp);
      c.mutable_plan()->set_tp(layout.tp);
      c.mutable_plan()->set_pp(layout.pp);
      c.mutable_plan()->set_micro_batch_size(2);
      SetFlag(&c, "axis_order", axis_order);
      SetFlag(&c, "rank_order", rank_order);
      c.mutable_checkpoint()->set_export_safetensors(path);
      return c;
    };
    const std::string usual = TestDir() + "/order/usual.safetensors";
    const std::string reordered = TestDir() + "/order/reordered.safetensors";
    ExpectSameLosses(single, TrainOnRanks(config("", "", usual), "order_usual"), 1e-5);
    ExpectSameLosses(single, TrainOnRanks(config(layout.axis_order, layout.rank_order, reordered), "order_reordered"),
                     1e-5);
    if (testing::IsRankProcess()) continue;  // the files are the parent's to compare
    auto expected = ReadSafetensors(usual);
    auto actual = ReadSafetensors(reordered);
    ASSERT_TRUE(expected.ok() && actual.ok());
    ASSERT_EQ(actual->tensors.size(), expected->tensors.size());
    for (const auto& [name, tensor] : expected->tensors) {
      auto same = actual->Get(name);
      ASSERT_TRUE(same.ok()) << same.status();
      EXPECT_TRUE(at::equal(*same, tensor)) << name;
    }
  }
}

// The semi-automatic mode: each optimization method of a strategy file, alone
// and combined as in the reference's examples, trains the losses of one
// process where it is a layout; precision methods train.
TEST(TrainerStrategyTest, StrategyMethodsTrainWithParity) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "strategy_reference");
  struct Case {
    const char* tag;
    int world_size;
    const char* methods;
    bool parity = true;
  };
  for (const Case& c : std::vector<Case>{
           {"data", 2, R"(methods { name: "parallel_mode" parallel_mode { name: "data" size: 2 } })"},
           {"zero1", 2, R"(methods { name: "zero1" })"},
           {"zero2", 2,
            R"(methods { name: "parallel_mode" parallel_mode { name: "zero" size: 2 } } methods { name: "zero2" })"},
           {"fsdp", 2, R"(methods { name: "fsdp" })"},
           {"checkpoint", 1, R"(methods { name: "checkpoint" layers: "transformer.h.1" })"},
           {"tensor_sp", 2, R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 2 } }
                              methods { name: "tensor_parallel" sequence_parallel: true })"},
           {"pipeline_zb", 2, R"(methods { name: "parallel_mode" parallel_mode { name: "pipeline" size: 2 } }
                                methods { name: "pipeline_parallel" schedule: "zb_h1" micro_batches: 4 })"},
           {"mixed", 4, R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 2 }
                              parallel_mode { name: "pipeline" size: 2 } }
                          methods { name: "mixed_parallel" } methods { name: "zero1" }
                          methods { name: "checkpoint" activation_checkpoint_ratio: 0.5 }
                          methods { name: "pipeline_parallel" micro_batches: 2 })"},
           {"amp_bf16", 2,
            R"(methods { name: "amp_native" dtype: "bf16" skip_if_nonfinite: true } methods { name: "zero2" })", false},
           {"half_bf16", 1, R"(methods { name: "half" dtype: "bf16" })", false},
           {"amp_bf16_tensor", 2, R"(methods { name: "parallel_mode" parallel_mode { name: "tensor" size: 2 } }
                                    methods { name: "tensor_parallel" } methods { name: "amp_native" dtype: "bf16" })",
            false}}) {
    SCOPED_TRACE(c.tag);
    const std::string path = absl::StrCat(TestDir(), "/", c.tag, ".strategy");
    if (!testing::IsRankProcess()) std::ofstream(path) << c.methods;
    TrainerConfig config = SmallConfig(c.world_size);  // the data axis takes the ranks the strategy leaves
    config.mutable_strategy()->set_load(path);
    ASSERT_EQ(ConfigWorldSize(config).value_or(0), c.world_size);
    const std::vector<double> losses = TrainOnRanks(config, absl::StrCat("strategy_", c.tag));
    if (c.parity) {
      ExpectSameLosses(single, losses, 1e-5);
    } else {
      ASSERT_EQ(losses.size(), single.size());
      EXPECT_NEAR(losses.back(), single.back(), 0.05 * single.back());
    }
  }
}

// ZeRO stages 1, 2 and 3 at dp = 2 and 4, and inside dp x tp and dp x pp layouts
// (the pipeline's tied embedding keeps whole gradients), train the losses of
// plain data parallelism (equal to one process's).
TEST(TrainerParityTest, ZeroLossesEqualPlainDataParallelism) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "zero_reference");
  struct Layout {
    int stage, dp, tp, pp;
    bool sequence_parallel = false;
  };
  for (const Layout& layout :
       {Layout{1, 2, 1, 1}, Layout{2, 2, 1, 1}, Layout{1, 4, 1, 1}, Layout{2, 4, 1, 1}, Layout{2, 2, 2, 1},
        Layout{2, 2, 1, 2}, Layout{1, 2, 1, 2}, Layout{3, 2, 1, 1}, Layout{3, 4, 1, 1}, Layout{3, 2, 2, 1},
        Layout{3, 2, 1, 2}, Layout{1, 2, 2, 1, true}, Layout{2, 2, 2, 1, true}, Layout{3, 2, 2, 1, true}}) {
    TrainerConfig config = SmallConfig(layout.dp);
    config.mutable_plan()->set_tp(layout.tp);
    config.mutable_plan()->set_pp(layout.pp);
    if (layout.pp > 1) config.mutable_plan()->set_micro_batch_size(2);
    config.mutable_plan()->mutable_zero()->set_stage(layout.stage);
    config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(layout.sequence_parallel);
    SetFlag(&config, "zero_reduce_bucket_size", 4096);  // several buckets
    SetFlag(&config, "zero_allgather_bucket_size", 8192);
    const std::string tag = absl::StrCat("zero", layout.stage, "_dp", layout.dp, "_tp", layout.tp, "_pp", layout.pp,
                                         layout.sequence_parallel ? "_sp" : "");
    SCOPED_TRACE(tag);
    ExpectSameLosses(single, TrainOnRanks(config, tag), 1e-5);
  }
}

// The error of this LibTorch's bf16 matrix product against the exact product
// of the same bf16 inputs, relative to its largest element: about 4e-3 where
// it accumulates in fp32 (oneDNN on CPUs with AVX-512), about 9e-2 where
// LibTorch 1.13's fallback accumulates in bf16 (measured on an AMD EPYC
// without AVX-512).
double Bf16ProductError() {
  torch::manual_seed(0);
  const at::Tensor a = torch::randn({256, 1024}).to(at::kBFloat16), b = torch::randn({1024, 256}).to(at::kBFloat16);
  const at::Tensor exact = at::mm(a.to(at::kFloat), b.to(at::kFloat));
  return ((at::mm(a, b).to(at::kFloat) - exact).abs().max() / exact.abs().max()).item<double>();
}

// bf16 compute (fp32 master weights) tracks the fp32 loss curve: the mean
// loss of steps 191-200 within 2% where bf16 products accumulate in fp32,
// within 10% where this LibTorch's own products accumulate in bf16. By then
// the losses are small (0.12-0.43) and one step's relative difference is
// noise (up to 2.5% on an AMD EPYC with AVX-512 BF16, both curves learning
// alike), so the bound is on the window's mean.
TEST(TrainerPrecisionTest, Bf16TracksFp32) {
  const double product_error = Bf16ProductError();
  const double bound = product_error < 1e-2 ? 0.02 : 0.10;
  TrainerConfig fp32 = SmallConfig(1);
  fp32.mutable_loop()->set_max_steps(200);
  TrainerConfig bf16 = fp32;
  bf16.mutable_plan()->mutable_precision()->set_mode("bf16");
  const std::vector<double> reference = TrainOnRanks(fp32, "fp32_200");
  const std::vector<double> mixed = TrainOnRanks(bf16, "bf16_200");
  ASSERT_EQ(mixed.size(), 200u);
  const double reference_mean = std::accumulate(reference.begin() + 190, reference.end(), 0.0) / 10;
  const double mixed_mean = std::accumulate(mixed.begin() + 190, mixed.end(), 0.0) / 10;
  const double relative = std::abs(mixed_mean - reference_mean) / reference_mean;
  EXPECT_LT(relative, bound) << "mean loss of steps 191-200: fp32 " << reference_mean << ", bf16 " << mixed_mean
                             << " (bf16 product error " << product_error << ")";
  EXPECT_LT(reference[199], reference[0] * 0.7) << "the model should learn";
  EXPECT_LT(mixed[199], reference[0] * 0.7) << "bf16 should learn";
  std::printf(
      "bf16 vs fp32, mean loss of steps 191-200: %.5f vs %.5f, relative difference %.3g (bf16 product "
      "error %.3g)\n",
      mixed_mean, reference_mean, relative, product_error);
}

// An inf gradient injected on one rank: every rank skips that update (weights
// unchanged), the dynamic loss scale halves, and training goes on.
class InjectInf : public TrainerHooks {
 public:
  explicit InjectInf(int rank) : rank_(rank) {}
  void AfterBackward(const TrainerState& state) override {
    if (state.step != 4 || rank_ != 1) return;  // the 5th step, on rank 1 only
    state.model.parameters().front().second.grad().view({-1})[0] = std::numeric_limits<float>::infinity();
  }
  void OnStepEnd(const TrainerState& state, const StepMetrics& m) override {
    metrics.push_back(m);
    snapshots.push_back(state.model.parameters().front().second.detach().clone());
  }
  int rank_;
  std::vector<StepMetrics> metrics;
  std::vector<at::Tensor> snapshots;
};

// Trains `config` (bf16, 2 data-parallel ranks) with InjectInf on each rank:
// the 5th step is skipped everywhere, leaving the weights, and training goes on.
void ExpectTheInfStepSkipped(const TrainerConfig& config, const std::function<void(const InjectInf&)>& check) {
  testing::RunOnRanks(2, [&](int rank) {
    auto topology = testing::JoinTopology({{"data", 2}});
    ASSERT_TRUE(topology.ok());
    auto trainer = Trainer::Create(config, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto hooks = std::make_shared<InjectInf>(rank);
    (*trainer)->AddHooks(hooks);
    auto result = (*trainer)->Train();
    ASSERT_TRUE(result.ok()) << result.status();
    ASSERT_EQ(hooks->metrics.size(), static_cast<size_t>(config.loop().max_steps()));
    for (size_t i = 0; i < hooks->metrics.size(); ++i) EXPECT_EQ(hooks->metrics[i].skipped, i == 4) << "step " << i + 1;
    EXPECT_TRUE(at::equal(hooks->snapshots[4], hooks->snapshots[3])) << "skipped: no update";
    EXPECT_FALSE(at::equal(hooks->snapshots[5], hooks->snapshots[4])) << "training goes on";
    EXPECT_TRUE(std::isfinite(result->losses.back()));
    check(*hooks);
  });
}

TEST(TrainerPrecisionTest, InfOnOneRankSkipsTheStepEverywhereAndHalvesTheScale) {
  TrainerConfig config = SmallConfig(2);
  config.mutable_plan()->mutable_precision()->set_mode("bf16");
  SetFlag(&config, "loss_scale", 0);  // dynamic loss scaling, asked for explicitly
  config.mutable_plan()->mutable_precision()->mutable_loss_scaler()->set_initial_scale_power(16);
  config.mutable_plan()->mutable_precision()->mutable_loss_scaler()->set_hysteresis(1);
  config.mutable_loop()->set_max_steps(10);
  ExpectTheInfStepSkipped(config, [](const InjectInf& hooks) {
    EXPECT_EQ(hooks.metrics[4].loss_scale, 65536);
    EXPECT_EQ(hooks.metrics[5].loss_scale, 32768);
  });
}

// amp_native's skip_if_nonfinite for bf16: the same skip, and nothing is ever scaled.
TEST(TrainerPrecisionTest, SkipIfNonfiniteSkipsWithoutScaling) {
  TrainerConfig config = SmallConfig(2);
  config.mutable_plan()->mutable_precision()->set_mode("bf16");
  SetFlag(&config, "skip_if_nonfinite", true);
  config.mutable_loop()->set_max_steps(8);
  ExpectTheInfStepSkipped(config, [](const InjectInf& hooks) {
    for (const StepMetrics& m : hooks.metrics) EXPECT_EQ(m.loss_scale, 1.0) << "step " << m.step;
  });
}

// wall_clock_breakdown: each rank's step by part, the parts within the step.
class RecordMetrics : public TrainerHooks {
 public:
  void OnStepEnd(const TrainerState&, const StepMetrics& m) override { metrics.push_back(m); }
  std::vector<StepMetrics> metrics;
};

TEST(TrainerMetricsTest, WallClockBreakdownSplitsEveryRanksStep) {
  TrainerConfig config = SmallConfig(2);
  config.mutable_plan()->set_pp(2);
  config.mutable_plan()->set_micro_batch_size(2);
  config.mutable_loop()->set_max_steps(3);
  config.mutable_output()->set_wall_clock_breakdown(true);
  testing::RunOnRanks(4, [&](int) {
    auto topology = testing::JoinTopology({{"data", 2}, {"pipeline", 2}});
    ASSERT_TRUE(topology.ok());
    auto trainer = Trainer::Create(config, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto hooks = std::make_shared<RecordMetrics>();
    (*trainer)->AddHooks(hooks);
    ASSERT_TRUE((*trainer)->Train().ok());
    ASSERT_EQ(hooks->metrics.size(), 3u);
    for (const StepMetrics& m : hooks->metrics) {
      std::map<std::string, double> parts(m.wall_clock_ms.begin(), m.wall_clock_ms.end());
      for (const char* part : {"data", "forward", "backward", "pipeline_p2p", "all_reduce", "optimizer", "step"}) {
        EXPECT_TRUE(parts.count(part)) << part;
      }
      EXPECT_GT(parts["forward"], 0);
      EXPECT_GT(parts["backward"], 0);
      EXPECT_NEAR(parts["step"], m.step_time_ms, 1e-6);
      EXPECT_LE(parts["data"] + parts["forward"] + parts["backward"] + parts["optimizer"], parts["step"]);
    }
  });
}

// Gradients divided by gradient_predivide_factor before the data-parallel sum
// and multiplied back after train the same losses, with and without ZeRO.
TEST(TrainerParityTest, PrescaledGradientsEqualOneProcess) {
  const std::vector<double> single = TrainOnRanks(SmallConfig(1), "prescale_reference");
  for (int zero : {0, 2}) {
    TrainerConfig config = SmallConfig(2);
    SetFlag(&config, "prescale_gradients", true);
    config.mutable_plan()->mutable_zero()->set_gradient_predivide_factor(4);
    config.mutable_plan()->mutable_zero()->set_stage(zero);
    SCOPED_TRACE(absl::StrCat("zero_stage ", zero));
    ExpectSameLosses(single, TrainOnRanks(config, absl::StrCat("prescale_zero", zero)), 1e-5);
  }
}

// Sampling runs across tensor-parallel ranks, pipeline stages (interleaved too)
// and ZeRO-3 replicas, and draws what one process draws; with the key/value
// cache (the default) it draws what it draws without, past the context of 32
// tokens too, for gpt and llama.
TEST(TrainerSampleTest, ParallelLayoutsSampleLikeOneProcess) {
  auto sample = [](TrainerConfig config, const std::string& tag) {
    config.mutable_loop()->set_max_steps(3);
    config.mutable_generation()->set_sample_tokens(40);
    const std::string path = TestDir() + "/" + tag + ".sample";
    TrainEverywhere(config, [&](const TrainResult& result) { std::ofstream(path) << result.sample; });
    std::ifstream in(path);
    return std::string(std::istreambuf_iterator<char>(in), {});
  };
  const std::string reference = sample(SmallConfig(1), "sample_reference");
  ASSERT_EQ(reference.size(), 40u);
  TrainerConfig uncached = SmallConfig(1);
  uncached.mutable_generation()->set_kv_cache(false);
  EXPECT_EQ(sample(uncached, "sample_uncached"), reference);
  TrainerConfig llama = SmallConfig(1);
  SetFlag(&llama, "model", "llama");
  SetFlag(&llama, "preset", "llama-tiny");
  SetFlag(&llama, "n_kv_head", 2);  // grouped-query attention: the cache holds 2 of 4 heads
  const std::string llama_reference = sample(llama, "sample_llama");
  llama.mutable_generation()->set_kv_cache(false);
  EXPECT_EQ(sample(llama, "sample_llama_uncached"), llama_reference);
  TrainerConfig layouts = SmallConfig(1);
  layouts.mutable_plan()->set_micro_batch_size(2);
  layouts.mutable_plan()->set_tp(2);
  layouts.mutable_plan()->set_pp(2);
  layouts.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(true);
  EXPECT_EQ(sample(layouts, "sample_tp2_pp2_sp"), reference);
  layouts.mutable_plan()->mutable_tensor_parallel()->set_parallel_vocab(
      false);  // the whole vocabulary's logits, on sequence shards
  EXPECT_EQ(sample(layouts, "sample_tp2_pp2_sp_whole_vocabulary"), reference);
  layouts.mutable_plan()->mutable_tensor_parallel()->set_parallel_vocab(true);
  layouts.mutable_plan()->set_tp(1);
  layouts.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(false);
  layouts.mutable_plan()->mutable_pipeline()->set_schedule("interleaved_1f1b");
  layouts.mutable_plan()->set_virtual_stages(2);
  EXPECT_EQ(sample(layouts, "sample_interleaved"), reference);
  TrainerConfig zero = SmallConfig(2);
  zero.mutable_plan()->mutable_zero()->set_stage(3);
  EXPECT_EQ(sample(zero, "sample_zero3"), reference);
}

// tp = 2, pp = 2 and tp x pp = 2 x 2 runs export the same model as a one-rank
// run: shards joined and stages merged under the single-process names. After 5
// AdamW steps the weights agree to 1e-5 (absolute; Adam's normalisation turns
// rounding-level differences of tiny gradients into weight differences of
// about 1e-6, printed below).
TEST(TrainerExportTest, ParallelExportsEqualOneProcess) {
  auto export_run = [](int tp, int pp) -> SafetensorsContents {
    const std::string tag = absl::StrCat("export_tp", tp, "_pp", pp);
    const std::string path = absl::StrCat(TestDir(), "/", tag, "/model.safetensors");
    TrainerConfig config = SmallConfig(1);
    config.mutable_plan()->set_tp(tp);
    config.mutable_plan()->set_pp(pp);
    config.mutable_plan()->set_micro_batch_size(2);
    config.mutable_loop()->set_max_steps(5);
    config.mutable_checkpoint()->set_export_safetensors(path);
    TrainOnRanks(config, tag);
    auto contents = ReadSafetensors(path);
    EXPECT_TRUE(contents.ok()) << contents.status();
    return contents.ok() ? *contents : SafetensorsContents();
  };
  const SafetensorsContents reference = export_run(1, 1);
  ASSERT_FALSE(reference.tensors.empty());
  for (const auto& [tp, pp] : std::vector<std::pair<int, int>>{{2, 1}, {1, 2}, {2, 2}}) {
    SCOPED_TRACE(absl::StrCat("tp=", tp, " pp=", pp));
    const SafetensorsContents exported = export_run(tp, pp);
    ASSERT_EQ(exported.tensors.size(), reference.tensors.size());
    double worst = 0;
    for (const auto& [name, expected] : reference.tensors) {
      auto other = exported.Get(name);
      ASSERT_TRUE(other.ok()) << name;
      ASSERT_EQ(other->sizes(), expected.sizes()) << name;
      const double diff = (*other - expected).abs().max().item<double>();
      worst = std::max(worst, diff);
      EXPECT_LE(diff, 1e-5) << name;
    }
    std::printf("largest weight difference against one rank, tp=%d pp=%d: %.3g\n", tp, pp, worst);
  }
}

TEST(TrainerParityTest, GradientAccumulationEqualsOneLargeMicroBatch) {
  TrainerConfig large = SmallConfig(1);
  TrainerConfig accumulated = SmallConfig(1);
  accumulated.mutable_plan()->set_micro_batch_size(2);
  accumulated.mutable_loop()->clear_global_batch_size();
  accumulated.mutable_plan()->set_num_micro_batches(4);
  ExpectSameLosses(TrainOnRanks(large, "mb8"), TrainOnRanks(accumulated, "mb2x4"), 1e-5);
}

TEST(TrainerExportTest, ExportedWeightsCarryTheReferenceNamesAndInitialiseAnotherRun) {
  const std::string exported = TestDir() + "/export/model.safetensors";
  TrainerConfig config = SmallConfig(2);
  config.mutable_loop()->set_max_steps(3);
  config.mutable_checkpoint()->set_export_safetensors(exported);
  TrainOnRanks(config, "export");
  auto contents = ReadSafetensors(exported);
  ASSERT_TRUE(contents.ok()) << contents.status();
  auto head = contents->Get("lm_head.weight");
  auto wte = contents->Get("transformer.wte.weight");
  ASSERT_TRUE(head.ok() && wte.ok());
  EXPECT_TRUE(at::equal(*head, *wte));
  EXPECT_TRUE(contents->Get("transformer.h.1.mlp.c_proj.bias").ok());

  // A run initialised from the export starts from exactly the exported weights.
  TrainerConfig from_export = SmallConfig(1);
  from_export.mutable_checkpoint()->set_init_from(exported);
  testing::RunOnRanks(1, [&](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    auto trainer = Trainer::Create(from_export, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    std::map<std::string, at::Tensor> parameters((*trainer)->model().parameters().begin(),
                                                 (*trainer)->model().parameters().end());
    for (const auto& [name, saved] : contents->tensors) {
      if (name == "lm_head.weight") continue;  // tied: stored as transformer.wte.weight
      EXPECT_TRUE(at::equal(parameters.at(name), saved)) << name;
    }
  });

  TrainerConfig wrong = SmallConfig(1);
  SetFlag(&wrong, "n_embd", 32);
  wrong.mutable_checkpoint()->set_init_from(exported);
  testing::RunOnRanks(1, [&](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    auto trainer = Trainer::Create(wrong, topology->get());
    ASSERT_FALSE(trainer.ok());
    EXPECT_THAT(std::string(trainer.status().message()), HasSubstr("is for another model size"));
  });
}

class RecordingHooks : public TrainerHooks {
 public:
  void OnTrainStart(const TrainerState&) override { events.push_back("train_start"); }
  void OnEpochStart(const TrainerState& s) override { events.push_back("epoch_start " + std::to_string(s.epoch)); }
  void OnStepStart(const TrainerState& s) override { events.push_back("step_start " + std::to_string(s.step)); }
  void BeforeZeroGrad(const TrainerState&) override { events.push_back("before_zero_grad"); }
  void AfterZeroGrad(const TrainerState&) override { events.push_back("after_zero_grad"); }
  void AfterAggregateTrainStepOutputs(const TrainerState&, double loss) override {
    events.push_back(loss > 0 ? "aggregated" : "aggregated zero");
  }
  void BeforeGnormClip(const TrainerState&) override { events.push_back("before_gnorm_clip"); }
  void AfterGnormClip(const TrainerState&, double norm) override {
    events.push_back(norm > 0 ? "after_gnorm_clip" : "after_gnorm_clip zero");
  }
  void BeforeOptimizerStep(const TrainerState&) override { events.push_back("before_optimizer"); }
  void AfterOptimizerStep(const TrainerState& s) override {
    events.push_back("after_optimizer " + std::to_string(s.step));
  }
  void OnStepEnd(const TrainerState&, const StepMetrics& m) override {
    events.push_back("step_end " + std::to_string(m.step));
  }
  void BeforeLogTrainMetrics(const TrainerState&, StepMetrics& m) override {
    events.push_back("before_log");
    m.loss = 42;  // what is logged may be changed here
  }
  void OnEpochEnd(const TrainerState&) override { events.push_back("epoch_end"); }
  void OnValStart(const TrainerState&) override { events.push_back("val_start"); }
  void OnValEnd(const TrainerState&, double) override { events.push_back("val_end"); }
  void OnSaveCheckpoint(const TrainerState&, const std::string&) override { events.push_back("save"); }
  void OnTrainEnd(const TrainerState&) override { events.push_back("train_end"); }
  std::vector<std::string> events;
};

// loop.lr_decay_steps ends the schedule early: min_lr from that step on.
TEST(TrainerScheduleTest, TheLearningRateReachesMinLrAtLrDecaySteps) {
  testing::RunOnRanks(1, [&](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    TrainerConfig config = SmallConfig(1);
    config.mutable_loop()->set_max_steps(6);
    config.mutable_loop()->set_warmup_steps(1);
    config.mutable_loop()->set_lr_decay_steps(3);
    auto trainer = Trainer::Create(config, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto hooks = std::make_shared<RecordMetrics>();
    (*trainer)->AddHooks(hooks);
    ASSERT_TRUE((*trainer)->Train().ok());
    ASSERT_EQ(hooks->metrics.size(), 6u);
    EXPECT_GT(hooks->metrics[2].lr, config.loop().min_lr());
    for (int s = 3; s < 6; ++s) EXPECT_DOUBLE_EQ(hooks->metrics[s].lr, config.loop().min_lr()) << "step " << s + 1;
  });
}

TEST(TrainerHooksTest, HooksRunInOrder) {
  testing::RunOnRanks(1, [&](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    TrainerConfig config = SmallConfig(1);
    config.mutable_loop()->set_max_steps(2);
    config.mutable_checkpoint()->set_save_dir(TestDir() + "/hooks");
    config.mutable_output()->set_metrics_file(TestDir() + "/hooks/metrics.jsonl");
    config.mutable_output()->set_log_every(1);
    auto trainer = Trainer::Create(config, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    auto hooks = std::make_shared<RecordingHooks>();
    (*trainer)->AddHooks(hooks);
    ASSERT_TRUE((*trainer)->Train().ok());
    const std::vector<std::string> step = {"before_zero_grad",  "after_zero_grad",  "aggregated",
                                           "before_gnorm_clip", "after_gnorm_clip", "before_optimizer"};
    std::vector<std::string> expected = {"train_start", "epoch_start 0", "step_start 0"};
    expected.insert(expected.end(), step.begin(), step.end());
    for (const char* e : {"after_optimizer 1", "step_end 1", "before_log", "step_start 1"}) expected.push_back(e);
    expected.insert(expected.end(), step.begin(), step.end());
    for (const char* e :
         {"after_optimizer 2", "step_end 2", "before_log", "epoch_end", "val_start", "val_end", "save", "train_end"}) {
      expected.push_back(e);
    }
    EXPECT_EQ(hooks->events, expected);
    std::ifstream metrics(TestDir() + "/hooks/metrics.jsonl");
    std::string first;
    std::getline(metrics, first);
    EXPECT_THAT(first, HasSubstr("{\"step\": 1, \"loss\": 42, "));
    EXPECT_THAT(first, HasSubstr("\"tokens_per_s\": "));
  });
}

}  // namespace
}  // namespace trident
