#include "trainer/config.h"

#include <cstdlib>
#include <fstream>
#include <type_traits>

#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "absl/strings/str_cat.h"
#include "base/status.h"

namespace trident {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

// Sets a flag of `c` as the command line would (an alias or a dotted path).
void SetFlag(TrainerConfig* c, const std::string& name, const std::string& value) {
  const absl::Status status = SetConfigFlag(name, value, c);
  ASSERT_TRUE(status.ok()) << status;
}
void SetFlag(TrainerConfig* c, const std::string& name, const char* value) { SetFlag(c, name, std::string(value)); }
void SetFlag(TrainerConfig* c, const std::string& name, bool value) { SetFlag(c, name, value ? "true" : "false"); }
template <typename Number, typename = std::enable_if_t<std::is_arithmetic_v<Number>>>
void SetFlag(TrainerConfig* c, const std::string& name, Number value) {
  SetFlag(c, name, absl::StrCat(value));
}

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(ConfigFlagsTest, FlagsOverrideFieldsByNameAndLeaveOthers) {
  TrainerConfig config = DefaultTrainerConfig();
  std::vector<std::string> args = {
      "--lr=3e-4",         "--model", "llama", "--noshuffle", "--config=x", "--dp=4", "--enable_progress_bar",
      "--prompt=Once upon"};
  ASSERT_TRUE(ApplyConfigFlags(&args, &config).ok());
  EXPECT_EQ(config.loop().lr(), 3e-4);
  EXPECT_EQ(config.model().type(), "llama");
  EXPECT_FALSE(config.dataset().shuffle());
  EXPECT_EQ(config.plan().dp(), 4);
  EXPECT_TRUE(config.output().enable_progress_bar());
  EXPECT_EQ(config.generation().prompt(), "Once upon");
  EXPECT_THAT(args, ElementsAre("--config=x"));
}

TEST(ConfigFlagsTest, ValuesThatDoNotParseNameTheFlag) {
  TrainerConfig config = DefaultTrainerConfig();
  std::vector<std::string> args = {"--max_steps=many"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--max_steps='many' is not a valid int64 value"));
  args = {"--lr"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--lr needs a value"));
}

TEST(ConfigFlagsTest, DottedFlagsSetNestedFieldsMapsAndLists) {
  TrainerConfig config = DefaultTrainerConfig();
  std::vector<std::string> args = {"--model.type=llama", "--model.args.n_layer=4", "--loop.lr=0.01",
                                   "--plan.zero.stage=3", "--checkpoint.save_dir=/tmp/x"};
  ASSERT_TRUE(ApplyConfigFlags(&args, &config).ok());
  EXPECT_EQ(config.model().type(), "llama");
  EXPECT_EQ(config.model().args().at("n_layer"), "4");
  EXPECT_EQ(config.loop().lr(), 0.01);
  EXPECT_EQ(config.plan().zero().stage(), 3);
  EXPECT_EQ(config.checkpoint().save_dir(), "/tmp/x");
  // The earlier message names, as aliases.
  config = DefaultTrainerConfig();
  args = {"--model_config.type=llama",
          "--model_config.args.n_layer=4",
          "--model_config.args.n_layer=6",
          "--optimizer_config.args.beta2=0.95",
          "--optimizer_config.clip_gnorm",
          "0.5",
          "--tp_layer_lists.col_para_list=c_fc",
          "--tp_layer_lists.col_para_list=c_attn",
          "--dataset_config.train_args.path.to=x"};
  ASSERT_TRUE(ApplyConfigFlags(&args, &config).ok());
  EXPECT_TRUE(args.empty());
  EXPECT_EQ(config.model().type(), "llama");
  EXPECT_EQ(config.model().args().size(), 1u);
  EXPECT_EQ(config.model().args().at("n_layer"), "6");  // the last flag wins
  EXPECT_EQ(config.optimizer().args().at("beta2"), "0.95");
  EXPECT_EQ(config.optimizer().clip_gnorm(), 0.5);
  EXPECT_THAT(config.plan().tensor_parallel().layer_lists().column(), ElementsAre("c_fc", "c_attn"));
  EXPECT_EQ(config.dataset().train_args().at("path.to"), "x");
  args = {"--model_config.kind=x"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("ModelSpec has no field 'kind'"));
  args = {"--loop.lr.value=1"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("'lr' is not a message"));
  args = {"--optimizer_config.clip_gnorm=high"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("is not a valid double value"));
}

// One run's layout given as flags, as a text config, and as the strategy
// file that run would save, makes the same plan.
TEST(ConfigFlagsTest, FlagsTextConfigAndSavedStrategyGiveTheSamePlan) {
  std::vector<std::string> args = {"--dp=2",
                                   "--pp=2",
                                   "--zero_stage=1",
                                   "--precision=bf16",
                                   "--schedule=zb_h1",
                                   "--micro_batch_size=2",
                                   "--global_batch_size=16",
                                   "--activation_checkpointing=selected",
                                   "--checkpoint_layers=transformer.h.1",
                                   "--checkpoint_modules=attn",
                                   "--module_replace=fused_attention",
                                   "--axis_order=data,pipeline,tensor",
                                   "--rank_order=3,2,1,0",
                                   "--precision_table=buffer=fp32",
                                   "--partition_method=parameters"};
  TrainerConfig from_flags = DefaultTrainerConfig();
  ASSERT_TRUE(ApplyConfigFlags(&args, &from_flags).ok());
  auto plan = ResolveConfig(&from_flags, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();

  const std::string dir = ::testing::TempDir();
  { std::ofstream(dir + "/run.pbtxt") << ConfigToText(from_flags); }
  auto from_text = LoadTrainerConfig(dir + "/run.pbtxt");
  ASSERT_TRUE(from_text.ok()) << from_text.status();

  ASSERT_TRUE(SaveStrategy(StrategyFromPlan(*plan), dir + "/run_strategy.pbtxt").ok());
  TrainerConfig from_strategy = DefaultTrainerConfig();
  from_strategy.mutable_strategy()->set_load(dir + "/run_strategy.pbtxt");
  from_strategy.mutable_loop()->set_global_batch_size(16);
  EXPECT_EQ(ConfigWorldSize(from_strategy).value_or(0), 4);

  // The same layout in the plan's own dotted names.
  args = {"--plan.dp=2",
          "--plan.pp=2",
          "--plan.zero.stage=1",
          "--plan.precision.mode=bf16",
          "--plan.pipeline.schedule=zb_h1",
          "--plan.micro_batch_size=2",
          "--global_batch_size=16",
          "--plan.recompute.method=selected",
          "--plan.recompute.layers=transformer.h.1",
          "--plan.recompute.modules=attn",
          "--plan.module_replace=fused_attention",
          "--plan.axis_order=data",
          "--plan.axis_order=pipeline",
          "--plan.axis_order=tensor",
          "--plan.rank_order=3",
          "--plan.rank_order=2",
          "--plan.rank_order=1",
          "--plan.rank_order=0",
          "--plan.precision.table=buffer=fp32",
          "--plan.pipeline.partition_method=parameters"};
  TrainerConfig from_dotted = DefaultTrainerConfig();
  ASSERT_TRUE(ApplyConfigFlags(&args, &from_dotted).ok());
  EXPECT_TRUE(args.empty());
  EXPECT_EQ(ConfigWorldSize(from_dotted).value_or(0), 4);

  const std::string expected = StrategyToText(StrategyFromPlan(*plan));
  EXPECT_THAT(expected, HasSubstr("rank_order: 3"));
  for (TrainerConfig* config : {&*from_text, &from_strategy, &from_dotted}) {
    const TrainerConfig given = *config;
    auto other = ResolveConfig(config, 4);
    ASSERT_TRUE(other.ok()) << other.status();
    EXPECT_EQ(config->DebugString(), given.DebugString()) << "resolving leaves the config as given";
    EXPECT_EQ(StrategyToText(StrategyFromPlan(*other)), expected);
    EXPECT_EQ(other->micro_batch_size(), plan->micro_batch_size());
    EXPECT_EQ(other->num_micro_batches(), 4);
    if (config != &from_strategy) {
      EXPECT_EQ(other->DebugString(), plan->DebugString());
    }
  }
}

// An alias and the dotted name of a field spell the same field: the later
// flag wins, an alias's comma list replaces the list, a dotted list grows by
// one item per flag, and an alias converts its units.
TEST(ConfigFlagsTest, AliasesAndDottedNamesSpellOneFieldAndTheLaterWins) {
  std::vector<std::string> args = {"--zero_stage=2",
                                   "--plan.zero.stage=3",
                                   "--plan.zero.allow_untested_optimizer",
                                   "--dp=4",
                                   "--plan.axis_order=tensor",
                                   "--axis_order=data,tensor,pipeline",
                                   "--plan.num_micro_batches=2",
                                   "--grad_accumulation_steps=3",
                                   "--zero_allgather_bucket_size=1000",
                                   "--bucket_size_mb=2",
                                   "--plan.trace.method=layers"};
  TrainerConfig config = DefaultTrainerConfig();
  ASSERT_TRUE(ApplyConfigFlags(&args, &config).ok());
  auto plan = ResolveConfig(&config, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->zero().stage(), 3);
  EXPECT_TRUE(plan->zero().allow_untested_optimizer());
  EXPECT_EQ(plan->zero().reduce_bucket_bytes(), 500000000LL * 4) << "the trainer's default";
  EXPECT_EQ(plan->zero().allgather_bucket_bytes(), 4000) << "fp32 elements";
  EXPECT_EQ(plan->zero().bucket_bytes(), 2 << 20);
  EXPECT_EQ(plan->dp(), 4);
  EXPECT_THAT(plan->axis_order(), ElementsAre("data", "tensor", "pipeline"));
  EXPECT_EQ(plan->num_micro_batches(), 3);
  EXPECT_EQ(plan->trace().method(), TraceSpec::layers);
  args = {"--plan.recompute.method=most"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)),
              HasSubstr("plan.recompute.method='most' is unknown; choose none, full, stage_aware, selected"));
  args = {"--plan.zero.stages=1"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("ZeroSpec has no field 'stages'"));
  args = {"--plan=1"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--plan names a group of fields"));
  args = {"--zero_reduce_bucket_size=lots"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--zero_reduce_bucket_size='lots' is no integer"));
  args = {"--tp_layer_lists.input_output_mapping=1:3"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)),
              HasSubstr("input_output_mapping '1:3' is not input:output:col"));
  args = {"--tp_layer_lists.weight_change_list=c_fc:2"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("weight_change_list 'c_fc:2' is not name:0"));
  args = {"--tp_layer_lists.tp_attr_list=n_head"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("rewrites the sizes a split changes"));
  args = {"--lora_config=/nonexistent.pbtxt"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("/nonexistent.pbtxt"));
}

// A text config of an earlier version (flat fields, the old message names)
// loads as the same configuration as the nested one.
TEST(ConfigFileTest, FlatConfigsOfEarlierVersionsLoad) {
  const std::string dir = ::testing::TempDir();
  std::ofstream(dir + "/flat.pbtxt") << R"(# an earlier version's config
model: "torchscript:/tmp/m.pt"
block_size: 64
lr: 3e-4   # a comment
dp: 4
zero_stage: 2
zero_reduce_bucket_size: 1000
checkpoint_layers: "h.0,h.1"
activation_checkpointing: "selected"
prompt: "{not a block}"
preset: ""
init_method_std: 0
lora_config: ""
adapter_name: "default"
loss_scale: -1
optimizer_config {
  type: "sgd"
  args { key: "momentum" value: "0.9" }
}
tp_layer_lists {
  col_para_list: "c_fc"
  input_output_mapping: "1:3:col"
}
tp_layer_lists { row_para_list: "mlp_proj" }
plan { tp: 2 }
)";
  auto flat = LoadTrainerConfig(dir + "/flat.pbtxt");
  ASSERT_TRUE(flat.ok()) << flat.status();
  TrainerConfig nested = DefaultTrainerConfig();
  ASSERT_TRUE(google::protobuf::TextFormat::MergeFromString(R"(
    model { type: "torchscript" args { key: "path" value: "/tmp/m.pt" } args { key: "block_size" value: "64" } }
    loop { lr: 3e-4 }
    generation { prompt: "{not a block}" }
    optimizer { type: "sgd" args { key: "momentum" value: "0.9" } }
    plan {
      dp: 4 tp: 2
      zero { stage: 2 reduce_bucket_bytes: 4000 }
      recompute { method: selected layers: "h.0" layers: "h.1" }
      tensor_parallel { layer_lists { column: "c_fc" row: "mlp_proj" input_output_mapping { input: 1 output: 3 column: true } } }
    })",
                                                            &nested));
  EXPECT_EQ(flat->DebugString(), nested.DebugString());
  std::ofstream(dir + "/bad.pbtxt") << "lr: 1\nzero_stage: many\n";
  EXPECT_THAT(Message(LoadTrainerConfig(dir + "/bad.pbtxt").status()),
              HasSubstr("config file " + dir + "/bad.pbtxt: line 2: flag --zero_stage='many' is not a valid"));
  std::ofstream(dir + "/unknown.pbtxt") << "lr: 1\nlearning_rate: 2\n";
  EXPECT_THAT(Message(LoadTrainerConfig(dir + "/unknown.pbtxt").status()), HasSubstr("line 2"));
}

// The plan's loss scaler as config.proto describes it.
ParallelPlan ResolvedPlan(TrainerConfig c) {
  auto plan = ResolveConfig(&c, 1);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.value_or(ParallelPlan());
}

TEST(ResolveConfigTest, Fp16ScalesDynamicallyUnlessTheConfigGivesAScale) {
  TrainerConfig c = DefaultTrainerConfig();
  c.mutable_plan()->set_dp(1);
  SetFlag(&c, "device", "cuda");
  c.mutable_plan()->mutable_precision()->set_mode("fp16");
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 0.0);  // dynamic, as config.proto says
  c.mutable_plan()->mutable_precision()->set_mode("pure_fp16");
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 0.0);
  SetFlag(&c, "loss_scale", 128);
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 128.0);
  c.mutable_plan()->mutable_precision()->set_mode("bf16");
  SetFlag(&c, "loss_scale", -1);
  SetFlag(&c, "skip_if_nonfinite", true);
  EXPECT_TRUE(ResolvedPlan(c).precision().loss_scaling());
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 1.0);  // only the skip
}

TEST(ResolveConfigTest, ALoadedStrategysLossScalerReachesThePlan) {
  const std::string path = ::testing::TempDir() + "/fp16.strategy";
  std::ofstream(path) << R"(methods { name: "amp_native" dtype: "fp16" initial_scale_power: 8 hysteresis: 3 })";
  TrainerConfig c = DefaultTrainerConfig();
  SetFlag(&c, "device", "cuda");
  c.mutable_strategy()->set_load(path);
  const ParallelPlan plan = ResolvedPlan(c);
  EXPECT_EQ(plan.precision().mode(), "fp16");
  EXPECT_EQ(plan.precision().loss_scaler().loss_scale(), 0.0);
  EXPECT_EQ(plan.precision().loss_scaler().initial_scale_power(), 8);
  EXPECT_EQ(plan.precision().loss_scaler().hysteresis(), 3);
  EXPECT_EQ(plan.precision().loss_scaler().loss_scale_window(), 1000);
}

TEST(ConfigFileTest, ShippedConfigsParse) {
  const char* srcdir = std::getenv("TEST_SRCDIR");
  ASSERT_NE(srcdir, nullptr);
  auto config = LoadTrainerConfig(std::string(srcdir) + "/trident/trainer/configs/default.pbtxt");
  ASSERT_TRUE(config.ok()) << config.status();
  EXPECT_EQ(config->model().args().at("preset"), "gpt-tiny");
  EXPECT_THAT(Message(LoadTrainerConfig("/nonexistent.pbtxt").status()),
              HasSubstr("cannot read config file /nonexistent.pbtxt"));
}

TEST(ResolveConfigTest, DerivesTheBatchSizesEitherWay) {
  TrainerConfig from_global = DefaultTrainerConfig();
  from_global.mutable_plan()->set_dp(2);
  from_global.mutable_plan()->set_micro_batch_size(4);
  from_global.mutable_loop()->set_global_batch_size(32);
  auto plan = ResolveConfig(&from_global, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_micro_batches(), 4);
  EXPECT_EQ(GlobalBatchSize(*plan), 32);

  TrainerConfig from_accumulation = DefaultTrainerConfig();
  from_accumulation.mutable_plan()->set_dp(1);
  from_accumulation.mutable_plan()->set_micro_batch_size(2);
  from_accumulation.mutable_plan()->set_num_micro_batches(3);
  plan = ResolveConfig(&from_accumulation, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_micro_batches(), 3);
  EXPECT_EQ(GlobalBatchSize(*plan), 6);
  EXPECT_FALSE(from_accumulation.loop().has_global_batch_size()) << "the plan holds the layout, not the config";
}

TEST(ResolveConfigTest, ElasticRunsLetDataParallelismFollowTheRankCount) {
  TrainerConfig layout = DefaultTrainerConfig();  // written for 8 ranks: dp=2 x tp=2 x pp=2, global batch 8 x 2 x 2
  layout.mutable_plan()->set_dp(2);
  layout.mutable_plan()->set_tp(2);
  layout.mutable_plan()->set_pp(2);
  layout.mutable_plan()->set_micro_batch_size(8);
  layout.mutable_plan()->set_num_micro_batches(2);
  layout.mutable_runtime()->set_elastic(true);
  TrainerConfig shrunk = layout;
  auto plan = ResolveConfig(&shrunk, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->dp(), 1);
  EXPECT_EQ(plan->tp(), 2);
  EXPECT_EQ(plan->pp(), 2);
  EXPECT_EQ(GlobalBatchSize(*plan), 32);
  EXPECT_EQ(plan->num_micro_batches(), 4);
  TrainerConfig grown = layout;
  plan = ResolveConfig(&grown, 16);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->dp(), 4);
  EXPECT_EQ(plan->num_micro_batches(), 1);
  TrainerConfig misfit = layout;
  EXPECT_THAT(Message(ResolveConfig(&misfit, 6).status()), HasSubstr("elastic: 6 ranks cannot hold tp*pp = 2*2 = 4"));
  TrainerConfig rigid = layout;
  rigid.mutable_runtime()->set_elastic(false);
  EXPECT_THAT(Message(ResolveConfig(&rigid, 4).status()), HasSubstr("or set elastic to let dp follow the rank count"));
}

// strategy=auto: the search starts from one rank holding the whole global
// batch; a chosen strategy keeps that batch.
TEST(ResolveConfigTest, TheAutomaticStrategyStartsFromOneRankAndKeepsTheGlobalBatch) {
  TrainerConfig c = DefaultTrainerConfig();
  SetFlag(&c, "strategy", "auto");
  c.mutable_plan()->set_dp(1);
  c.mutable_plan()->set_micro_batch_size(4);
  c.mutable_plan()->set_num_micro_batches(2);
  auto plan = ResolveConfig(&c, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->dp() * plan->tp() * plan->pp(), 1);
  EXPECT_EQ(plan->micro_batch_size(), 8);
  EXPECT_EQ(plan->num_micro_batches(), 1);
  Strategy strategy;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"(methods { name: "parallel_mode" parallel_mode { name: "data" size: 4 } })", &strategy));
  ASSERT_TRUE(ApplyStrategy(strategy, 4, &*plan).ok());
  ASSERT_TRUE(KeepGlobalBatch(8, &*plan).ok());
  EXPECT_EQ(plan->dp(), 4);
  EXPECT_EQ(plan->micro_batch_size(), 2);
  plan->set_num_micro_batches(3);
  EXPECT_THAT(Message(KeepGlobalBatch(8, &*plan)),
              HasSubstr("global_batch_size=8 is not divisible by dp*micro_batches = 4*3"));
}

TEST(ResolveConfigTest, BadConfigurationsNameTheFieldAndTheFix) {
  auto error = [](auto edit, int world) {
    TrainerConfig c = DefaultTrainerConfig();
    c.mutable_plan()->set_dp(world);
    edit(c);
    return Message(ResolveConfig(&c, world).status());
  };
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_plan()->set_dp(3); }, 2),
              HasSubstr("dp*tp*pp = 3*1*1 = 3 but 2 ranks were started"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_loop()->set_global_batch_size(10); }, 2),
              HasSubstr("global_batch_size=10 is not divisible by micro_batch_size*dp = 8*2 = 16"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.mutable_loop()->set_global_batch_size(32);
                    c.mutable_plan()->set_num_micro_batches(3);
                  },
                  2),
              HasSubstr("disagree"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_loop()->set_lr(-1); }, 1), HasSubstr("lr=-1 must be positive"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_loop()->set_lr_scheduler("step"); }, 1),
              HasSubstr("unknown lr_scheduler 'step'; choose constant, cosine, linear"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_checkpoint()->set_save_every(5); }, 1),
              HasSubstr("need save_dir"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_output()->set_profile_step(c.loop().max_steps() + 1); }, 1),
              HasSubstr("is not a step of this run"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_output()->set_tp_plan_report(true); }, 1),
              HasSubstr("tp_plan_report prints the automatic tensor-parallel plan of a run with tp > 1"));
  EXPECT_THAT(
      error([](TrainerConfig& c) { c.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(true); }, 1),
      HasSubstr("sequence_parallel needs tp > 1"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_plan()->mutable_tensor_parallel()->set_overlapping_level(3); }, 1),
              HasSubstr("tp_overlapping_level=3: 0 (none), 1 (sub-pipelined products inside each parallel layer) "
                        "and 2 (sub-pipelined transformer blocks) are implemented; 3 (overlap between blocks) is not"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.mutable_plan()->set_dp(1);
                    c.mutable_plan()->set_tp(2);
                    c.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(true);
                    c.mutable_plan()->mutable_tensor_parallel()->set_overlapping_level(1);
                  },
                  2),
              HasSubstr("with sequence_parallel the layers all-gather and reduce-scatter instead"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.mutable_plan()->set_dp(1);
                    c.mutable_plan()->set_pp(2);
                    c.mutable_plan()->set_micro_batch_size(2);
                    c.mutable_loop()->set_global_batch_size(8);
                    c.mutable_plan()->mutable_pipeline()->set_schedule("zb_h1");
                    c.mutable_plan()->mutable_zero()->set_stage(3);
                  },
                  2),
              HasSubstr("zero_stage=3 with schedule zb_h1"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_plan()->mutable_zero()->set_gather_bucket_bytes(-1); }, 1),
              HasSubstr("gather_bucket_bytes=-1 is negative: give a size in bytes, or 0 for a bucket per layer"));
  // Pipeline schedules are checked against pp and the micro-batch count.
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_plan()->mutable_pipeline()->set_schedule("zigzag"); }, 1),
              HasSubstr("unknown schedule 'zigzag'"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.mutable_plan()->set_dp(1);
                    c.mutable_plan()->set_pp(2);
                    c.mutable_plan()->mutable_pipeline()->set_schedule("shifted_critical_path");
                  },
                  2),
              HasSubstr("needs at least 4 micro-batches per step; got 1"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.mutable_plan()->set_dp(1);
                    c.mutable_plan()->set_pp(2);
                    c.mutable_plan()->mutable_pipeline()->set_schedule("interleaved_1f1b");
                    c.mutable_plan()->set_virtual_stages(2);
                    c.mutable_plan()->set_micro_batch_size(1);
                    c.mutable_loop()->set_global_batch_size(3);
                  },
                  2),
              HasSubstr("micro-batches per step (3) to be a multiple of the pipeline stages (2)"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_plan()->set_virtual_stages(2); }, 1),
              HasSubstr("virtual_stages = 2 needs schedule interleaved_1f1b"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_plan()->mutable_trace()->set_split_method("zigzag"); }, 1),
              HasSubstr("unknown split_method 'zigzag'; choose farthest_min_deps, nearest_min_deps, or layer_split"));
  TrainerConfig c = DefaultTrainerConfig();
  EXPECT_THAT(Message(SetConfigFlag("grad_reduction", "median", &c)),
              HasSubstr("grad_reduction='median' is unknown; choose mean, sum, per_token_mean"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_model()->set_loss("hinge"); }, 1),
              HasSubstr("unknown loss 'hinge'; choose cross_entropy, mse"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.mutable_plan()->set_dp(1);
                    c.mutable_plan()->set_pp(2);
                    SetFlag(&c, "custom_split_points", "transformer.h.1,transformer.h.2");
                  },
                  2),
              HasSubstr("names 2 layer(s) but pp*virtual_stages = 2 stages need 1"));
}

// The model a config names comes from the registry, with the zoo's presets
// and overrides, and is checked against the layout before any rank starts.
TEST(ModelComponentTest, PresetsOverridesAndChecks) {
  auto source = [](const TrainerConfig& c) -> absl::StatusOr<ModelSource> {
    auto [type, args] = ModelComponent(c);
    TRIDENT_ASSIGN_OR_RETURN(ModelFactory factory, ModelRegistry().Find(type));
    ModelContext context;
    context.tp = {c.plan().tp(), 0, "tp", false};
    context.data_vocab_size = 256;
    TRIDENT_ASSIGN_OR_RETURN(ModelSource model, factory(args, context));
    ParallelPlan plan;  // the fields CheckSource reads (ResolveConfig would refuse some pairs first)
    plan.set_tp(c.plan().tp());
    plan.set_pp(c.plan().pp());
    plan.set_virtual_stages(c.plan().virtual_stages());
    plan.mutable_trace()->set_split_method(c.plan().trace().split_method());
    TRIDENT_RETURN_IF_ERROR(CheckSource(model, plan));
    return model;
  };
  TrainerConfig c = DefaultTrainerConfig();
  SetFlag(&c, "model", "llama");
  SetFlag(&c, "preset", "llama-tiny");
  SetFlag(&c, "n_layer", 3);
  auto model = source(c);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->num_layers, 5);
  EXPECT_EQ(model->vocab_size, 256);
  c.mutable_plan()->set_pp(2);
  c.mutable_plan()->set_virtual_stages(3);
  EXPECT_THAT(Message(source(c).status()),
              HasSubstr("pp*virtual_stages = 6 pipeline stages but the model has 5 layers"));
  c.mutable_plan()->set_virtual_stages(1);
  c.mutable_plan()->mutable_trace()->set_split_method("farthest_min_deps");
  EXPECT_THAT(Message(source(c).status()), HasSubstr("use layer_split"));
  c.mutable_plan()->set_pp(1);
  c.mutable_plan()->mutable_trace()->clear_split_method();
  c.mutable_plan()->set_tp(3);  // heads and vocabulary are checked against tp before any rank starts
  EXPECT_THAT(Message(source(c).status()), HasSubstr("is not divisible by tp=3"));
  c.mutable_plan()->set_tp(1);
  SetFlag(&c, "model", "bert");
  EXPECT_THAT(Message(source(c).status()), HasSubstr("unknown model 'bert'; choose gpt, llama, mlp, torchscript"));
  SetFlag(&c, "model", "gpt");
  SetFlag(&c, "preset", "gpt-tiny");
  SetFlag(&c, "vocab_size", 100);
  EXPECT_THAT(Message(source(c).status()), HasSubstr("vocab_size=100 is smaller than the data's 256-token vocabulary"));
  TrainerConfig scripted = DefaultTrainerConfig();
  SetFlag(&scripted, "model", "torchscript:/nonexistent/model.pt");
  SetFlag(&scripted, "block_size", 64);
  EXPECT_EQ(ModelComponent(scripted).first, "torchscript");
  EXPECT_THAT(Message(source(scripted).status()), HasSubstr("cannot read TorchScript file /nonexistent/model.pt"));
}

// A config file may name components by type with their arguments.
TEST(ModelComponentTest, ComponentsByTypeWithTheirArguments) {
  TrainerConfig c = DefaultTrainerConfig();
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"(model { type: "mlp" args { key: "n_layer" value: "2" } }
         optimizer { type: "sgd" args { key: "momentum" value: "0.9" } clip_gnorm: 0.5 })",
      &c));
  auto [type, args] = ModelComponent(c);
  EXPECT_EQ(type, "mlp");
  EXPECT_EQ(args.GetString("n_layer", ""), "2");
  auto [optimizer, optimizer_args] = OptimizerComponent(c);
  EXPECT_EQ(optimizer, "sgd");
  EXPECT_TRUE(MakeOptimizerFactory(optimizer, optimizer_args).ok());
  EXPECT_EQ(c.optimizer().clip_gnorm(), 0.5);
  TrainerConfig adamw = DefaultTrainerConfig();
  EXPECT_EQ(OptimizerComponent(adamw).first, "adamw");
  EXPECT_EQ(OptimizerComponent(adamw).second.GetString("weight_decay", ""), "0.1");  // the trainer's default
  SetFlag(&adamw, "weight_decay", 0.5);
  EXPECT_EQ(OptimizerComponent(adamw).second.GetString("weight_decay", ""), "0.5");
  EXPECT_EQ(OptimizerComponent(adamw).second.GetString("beta2", ""), "0.95");
}

TEST(ConfigToTextTest, PrintsDefaultsToo) {
  TrainerConfig c = DefaultTrainerConfig();
  c.mutable_loop()->set_lr(0.5);
  const std::string text = ConfigToText(c);
  EXPECT_THAT(text, HasSubstr("lr: 0.5"));
  EXPECT_THAT(text, HasSubstr("lr_scheduler: \"cosine\""));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("n_layer")));
}

// The whole text (what runs save beside their checkpoints) reads back as the
// same run: no field whose presence matters is filled in with its default.
TEST(ConfigToTextTest, TheWholeTextReadsBackAsTheSameRun) {
  TrainerConfig llama = DefaultTrainerConfig();
  SetFlag(&llama, "model", "llama");
  SetFlag(&llama, "n_layer", 3);
  TrainerConfig script = DefaultTrainerConfig();
  SetFlag(&script, "model", "torchscript:/tmp/model.pt");
  for (const TrainerConfig& config : {llama, script, DefaultTrainerConfig()}) {
    TrainerConfig again = DefaultTrainerConfig();
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(ConfigToText(config), &again));
    EXPECT_EQ(ModelComponent(again).first, ModelComponent(config).first);
    EXPECT_EQ(ModelComponent(again).second.values(), ModelComponent(config).second.values());
    auto plan = ResolveConfig(&again, again.plan().dp());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(plan->precision().loss_scaling());
  }
  EXPECT_EQ(ModelComponent(llama).second.GetString("preset", ""), "llama-tiny");
}

TEST(ConfigToTextTest, ChangesListOnlyWhatDiffersFromTheDefaults) {
  TrainerConfig c = DefaultTrainerConfig();
  c.mutable_loop()->set_lr(0.5);
  c.mutable_plan()->set_dp(2);  // set, but the default
  SetFlag(&c, "model", "llama");
  SetFlag(&c, "zero_stage", 1);
  EXPECT_EQ(ConfigChangesToText(c), "model { type: \"llama\" } plan { zero { stage: 1 } } loop { lr: 0.5 }");
  EXPECT_EQ(ConfigChangesToText(DefaultTrainerConfig()), "");
}

}  // namespace
}  // namespace trident
