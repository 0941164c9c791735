#include "trainer/config.h"

#include <cstdlib>
#include <fstream>

#include <gmock/gmock.h>
#include <google/protobuf/text_format.h>
#include <gtest/gtest.h>

#include "base/status.h"

namespace trident {
namespace {

using ::testing::ElementsAre;
using ::testing::HasSubstr;

std::string Message(const absl::Status& s) { return std::string(s.message()); }

TEST(ConfigFlagsTest, FlagsOverrideFieldsByNameAndLeaveOthers) {
  TrainerConfig config;
  std::vector<std::string> args = {
      "--lr=3e-4",         "--model", "llama", "--noshuffle", "--config=x", "--dp=4", "--enable_progress_bar",
      "--prompt=Once upon"};
  ASSERT_TRUE(ApplyConfigFlags(&args, &config).ok());
  EXPECT_EQ(config.lr(), 3e-4);
  EXPECT_EQ(config.model(), "llama");
  EXPECT_FALSE(config.shuffle());
  EXPECT_EQ(config.dp(), 4);
  EXPECT_TRUE(config.enable_progress_bar());
  EXPECT_EQ(config.prompt(), "Once upon");
  EXPECT_THAT(args, ElementsAre("--config=x"));
}

TEST(ConfigFlagsTest, ValuesThatDoNotParseNameTheFlag) {
  TrainerConfig config;
  std::vector<std::string> args = {"--max_steps=many"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--max_steps='many' is not a valid int64 value"));
  args = {"--lr"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--lr needs a value"));
}

TEST(ConfigFlagsTest, DottedFlagsSetNestedFieldsMapsAndLists) {
  TrainerConfig config;
  std::vector<std::string> args = {"--model_config.type=llama",
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
  EXPECT_EQ(config.model_config().type(), "llama");
  EXPECT_EQ(config.model_config().args().size(), 1u);
  EXPECT_EQ(config.model_config().args().at("n_layer"), "6");  // the last flag wins
  EXPECT_EQ(config.optimizer_config().args().at("beta2"), "0.95");
  EXPECT_EQ(config.optimizer_config().clip_gnorm(), 0.5);
  EXPECT_THAT(config.tp_layer_lists().col_para_list(), ElementsAre("c_fc", "c_attn"));
  EXPECT_EQ(config.dataset_config().train_args().at("path.to"), "x");
  args = {"--model_config.kind=x"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("ModelConfig has no field 'kind'"));
  args = {"--lr.value=1"};
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
  TrainerConfig from_flags;
  ASSERT_TRUE(ApplyConfigFlags(&args, &from_flags).ok());
  auto plan = ResolveConfig(&from_flags, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();

  const std::string dir = ::testing::TempDir();
  { std::ofstream(dir + "/run.pbtxt") << ConfigToText(from_flags); }
  auto from_text = LoadTrainerConfig(dir + "/run.pbtxt");
  ASSERT_TRUE(from_text.ok()) << from_text.status();

  ASSERT_TRUE(SaveStrategy(StrategyFromPlan(*plan), dir + "/run_strategy.pbtxt").ok());
  TrainerConfig from_strategy;
  from_strategy.set_load_strategy(dir + "/run_strategy.pbtxt");
  from_strategy.set_global_batch_size(16);
  EXPECT_EQ(ConfigWorldSize(from_strategy).value_or(0), 4);

  // The same layout in the plan's own dotted names (the flat fields left at
  // their defaults).
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
  TrainerConfig from_dotted;
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

// A field of `plan` wins over the flat alias of the same knob, a list of it
// replaces the flat list, and what it leaves unset the flat fields give.
TEST(ConfigFlagsTest, ThePlansFieldsWinOverTheirFlatAliases) {
  std::vector<std::string> args = {"--zero_stage=2",
                                   "--plan.zero.stage=3",
                                   "--plan.zero.allow_untested_optimizer",
                                   "--dp=4",
                                   "--axis_order=data,tensor,pipeline",
                                   "--plan.axis_order=pipeline",
                                   "--plan.axis_order=data",
                                   "--plan.axis_order=tensor",
                                   "--grad_accumulation_steps=3",
                                   "--plan.num_micro_batches=2",
                                   "--plan.trace.method=layers"};
  TrainerConfig config;
  ASSERT_TRUE(ApplyConfigFlags(&args, &config).ok());
  auto plan = ResolveConfig(&config, 4);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->zero().stage(), 3);
  EXPECT_TRUE(plan->zero().allow_untested_optimizer());
  EXPECT_EQ(plan->zero().reduce_bucket_bytes(), 500000000LL * 4) << "from the flat zero_reduce_bucket_size";
  EXPECT_EQ(plan->dp(), 4);
  EXPECT_THAT(plan->axis_order(), ElementsAre("pipeline", "data", "tensor"));
  EXPECT_EQ(plan->num_micro_batches(), 2);
  EXPECT_EQ(plan->trace().method(), TraceSpec::layers);
  args = {"--plan.recompute.method=most"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("--plan.recompute.method='most' is not a valid"));
  args = {"--plan.zero.stages=1"};
  EXPECT_THAT(Message(ApplyConfigFlags(&args, &config)), HasSubstr("ZeroSpec has no field 'stages'"));
}

// The plan's loss scaler as config.proto describes it.
ParallelPlan ResolvedPlan(TrainerConfig c) {
  auto plan = ResolveConfig(&c, 1);
  EXPECT_TRUE(plan.ok()) << plan.status();
  return plan.value_or(ParallelPlan());
}

TEST(ResolveConfigTest, Fp16ScalesDynamicallyUnlessTheConfigGivesAScale) {
  TrainerConfig c;
  c.set_dp(1);
  c.set_device("cuda");
  c.set_precision("fp16");
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 0.0);  // dynamic, as config.proto says
  c.set_precision("pure_fp16");
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 0.0);
  c.set_loss_scale(128);
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 128.0);
  c.set_precision("bf16");
  c.clear_loss_scale();
  c.set_skip_if_nonfinite(true);
  EXPECT_TRUE(ResolvedPlan(c).precision().loss_scaling());
  EXPECT_EQ(ResolvedPlan(c).precision().loss_scaler().loss_scale(), 1.0);  // only the skip
}

TEST(ResolveConfigTest, ALoadedStrategysLossScalerReachesThePlan) {
  const std::string path = ::testing::TempDir() + "/fp16.strategy";
  std::ofstream(path) << R"(methods { name: "amp_native" dtype: "fp16" initial_scale_power: 8 hysteresis: 3 })";
  TrainerConfig c;
  c.set_device("cuda");
  c.set_load_strategy(path);
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
  EXPECT_EQ(config->preset(), "gpt-tiny");
  EXPECT_THAT(Message(LoadTrainerConfig("/nonexistent.pbtxt").status()),
              HasSubstr("cannot read config file /nonexistent.pbtxt"));
}

TEST(ResolveConfigTest, DerivesTheBatchSizesEitherWay) {
  TrainerConfig from_global;
  from_global.set_dp(2);
  from_global.set_micro_batch_size(4);
  from_global.set_global_batch_size(32);
  auto plan = ResolveConfig(&from_global, 2);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_micro_batches(), 4);
  EXPECT_EQ(GlobalBatchSize(*plan), 32);

  TrainerConfig from_accumulation;
  from_accumulation.set_dp(1);
  from_accumulation.set_micro_batch_size(2);
  from_accumulation.set_grad_accumulation_steps(3);
  plan = ResolveConfig(&from_accumulation, 1);
  ASSERT_TRUE(plan.ok()) << plan.status();
  EXPECT_EQ(plan->num_micro_batches(), 3);
  EXPECT_EQ(GlobalBatchSize(*plan), 6);
  EXPECT_FALSE(from_accumulation.has_global_batch_size()) << "the plan holds the layout, not the config";
}

TEST(ResolveConfigTest, ElasticRunsLetDataParallelismFollowTheRankCount) {
  TrainerConfig layout;  // written for 8 ranks: dp=2 x tp=2 x pp=2, global batch 8 x 2 x 2
  layout.set_dp(2);
  layout.set_tp(2);
  layout.set_pp(2);
  layout.set_micro_batch_size(8);
  layout.set_grad_accumulation_steps(2);
  layout.set_elastic(true);
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
  rigid.set_elastic(false);
  EXPECT_THAT(Message(ResolveConfig(&rigid, 4).status()), HasSubstr("or set elastic to let dp follow the rank count"));
}

// strategy=auto: the search starts from one rank holding the whole global
// batch; a chosen strategy keeps that batch.
TEST(ResolveConfigTest, TheAutomaticStrategyStartsFromOneRankAndKeepsTheGlobalBatch) {
  TrainerConfig c;
  c.set_strategy("auto");
  c.set_dp(1);
  c.set_micro_batch_size(4);
  c.set_grad_accumulation_steps(2);
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
    TrainerConfig c;
    c.set_dp(world);
    edit(c);
    return Message(ResolveConfig(&c, world).status());
  };
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_dp(3); }, 2),
              HasSubstr("dp*tp*pp = 3*1*1 = 3 but 2 ranks were started"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_global_batch_size(10); }, 2),
              HasSubstr("global_batch_size=10 is not divisible by micro_batch_size*dp = 8*2 = 16"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.set_global_batch_size(32);
                    c.set_grad_accumulation_steps(3);
                  },
                  2),
              HasSubstr("disagree"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_lr(-1); }, 1), HasSubstr("lr=-1 must be positive"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_lr_scheduler("step"); }, 1),
              HasSubstr("unknown lr_scheduler 'step'; choose constant, cosine, linear"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_save_every(5); }, 1), HasSubstr("need save_dir"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_profile_step(c.max_steps() + 1); }, 1),
              HasSubstr("is not a step of this run"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_tp_layer_lists()->add_input_output_mapping("1:3"); }, 1),
              HasSubstr("input_output_mapping '1:3' is not input:output:col"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_tp_layer_lists()->add_weight_change_list("c_fc:2"); }, 1),
              HasSubstr("weight_change_list 'c_fc:2' is not name:0"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.mutable_tp_layer_lists()->add_tp_attr_list("n_head"); }, 1),
              HasSubstr("rewrites the sizes a split changes"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_tp_plan_report(true); }, 1),
              HasSubstr("tp_plan_report prints the automatic tensor-parallel plan of a run with tp > 1"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_sequence_parallel(true); }, 1),
              HasSubstr("sequence_parallel needs tp > 1"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_tp_overlapping_level(3); }, 1),
              HasSubstr("tp_overlapping_level=3: 0 (none), 1 (sub-pipelined products inside each parallel layer) "
                        "and 2 (sub-pipelined transformer blocks) are implemented; 3 (overlap between blocks) is not"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.set_dp(1);
                    c.set_tp(2);
                    c.set_sequence_parallel(true);
                    c.set_tp_overlapping_level(1);
                  },
                  2),
              HasSubstr("with sequence_parallel the layers all-gather and reduce-scatter instead"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.set_dp(1);
                    c.set_pp(2);
                    c.set_micro_batch_size(2);
                    c.set_global_batch_size(8);
                    c.set_schedule("zb_h1");
                    c.set_zero_stage(3);
                  },
                  2),
              HasSubstr("zero_stage=3 with schedule zb_h1"));
  // Pipeline schedules are checked against pp and the micro-batch count.
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_schedule("zigzag"); }, 1), HasSubstr("unknown schedule 'zigzag'"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.set_dp(1);
                    c.set_pp(2);
                    c.set_schedule("shifted_critical_path");
                  },
                  2),
              HasSubstr("needs at least 4 micro-batches per step; got 1"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.set_dp(1);
                    c.set_pp(2);
                    c.set_schedule("interleaved_1f1b");
                    c.set_virtual_stages(2);
                    c.set_micro_batch_size(1);
                    c.set_global_batch_size(3);
                  },
                  2),
              HasSubstr("micro-batches per step (3) to be a multiple of the pipeline stages (2)"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_virtual_stages(2); }, 1),
              HasSubstr("virtual_stages = 2 needs schedule interleaved_1f1b"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_split_method("zigzag"); }, 1),
              HasSubstr("unknown split_method 'zigzag'; choose farthest_min_deps, nearest_min_deps, or layer_split"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_grad_reduction("median"); }, 1),
              HasSubstr("grad_reduction='median' is unknown; choose mean, sum, per_token_mean"));
  EXPECT_THAT(error([](TrainerConfig& c) { c.set_loss("hinge"); }, 1),
              HasSubstr("unknown loss 'hinge'; choose cross_entropy, mse"));
  EXPECT_THAT(error(
                  [](TrainerConfig& c) {
                    c.set_dp(1);
                    c.set_pp(2);
                    c.set_custom_split_points("transformer.h.1,transformer.h.2");
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
    context.tp = {c.tp(), 0, "tp", false};
    context.data_vocab_size = 256;
    TRIDENT_ASSIGN_OR_RETURN(ModelSource model, factory(args, context));
    ParallelPlan plan;  // the fields CheckSource reads (ResolveConfig would refuse some pairs first)
    plan.set_tp(c.tp());
    plan.set_pp(c.pp());
    plan.set_virtual_stages(c.virtual_stages());
    plan.mutable_trace()->set_split_method(c.split_method());
    TRIDENT_RETURN_IF_ERROR(CheckSource(model, plan));
    return model;
  };
  TrainerConfig c;
  c.set_model("llama");
  c.set_preset("llama-tiny");
  c.set_n_layer(3);
  auto model = source(c);
  ASSERT_TRUE(model.ok()) << model.status();
  EXPECT_EQ(model->num_layers, 5);
  EXPECT_EQ(model->vocab_size, 256);
  c.set_pp(2);
  c.set_virtual_stages(3);
  EXPECT_THAT(Message(source(c).status()),
              HasSubstr("pp*virtual_stages = 6 pipeline stages but the model has 5 layers"));
  c.set_virtual_stages(1);
  c.set_split_method("farthest_min_deps");
  EXPECT_THAT(Message(source(c).status()), HasSubstr("use layer_split"));
  c.set_pp(1);
  c.clear_split_method();
  c.set_tp(3);  // heads and vocabulary are checked against tp before any rank starts
  EXPECT_THAT(Message(source(c).status()), HasSubstr("is not divisible by tp=3"));
  c.set_tp(1);
  c.set_model("bert");
  EXPECT_THAT(Message(source(c).status()), HasSubstr("unknown model 'bert'; choose gpt, llama, mlp, torchscript"));
  c.set_model("gpt");
  c.set_preset("gpt-tiny");
  c.set_vocab_size(100);
  EXPECT_THAT(Message(source(c).status()), HasSubstr("vocab_size=100 is smaller than the data's 256-token vocabulary"));
  TrainerConfig scripted;
  scripted.set_model("torchscript:/nonexistent/model.pt");
  scripted.set_block_size(64);
  EXPECT_EQ(ModelComponent(scripted).first, "torchscript");
  EXPECT_THAT(Message(source(scripted).status()), HasSubstr("cannot read TorchScript file /nonexistent/model.pt"));
}

// A config file may name components by type with their arguments.
TEST(ModelComponentTest, ComponentMessagesWinOverFlatFields) {
  TrainerConfig c;
  ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(
      R"(model_config { type: "mlp" args { key: "n_layer" value: "2" } }
         optimizer_config { type: "sgd" args { key: "momentum" value: "0.9" } clip_gnorm: 0.5 })",
      &c));
  auto [type, args] = ModelComponent(c);
  EXPECT_EQ(type, "mlp");
  EXPECT_EQ(args.GetString("n_layer", ""), "2");
  auto [optimizer, optimizer_args] = OptimizerComponent(c);
  EXPECT_EQ(optimizer, "sgd");
  EXPECT_TRUE(MakeOptimizerFactory(optimizer, optimizer_args).ok());
  EXPECT_EQ(GradientClip(c), 0.5);
  TrainerConfig flat;
  EXPECT_EQ(OptimizerComponent(flat).first, "adamw");
  EXPECT_EQ(OptimizerComponent(flat).second.GetString("weight_decay", ""), "0.1");
}

TEST(ConfigToTextTest, PrintsDefaultsToo) {
  TrainerConfig c;
  c.set_lr(0.5);
  const std::string text = ConfigToText(c);
  EXPECT_THAT(text, HasSubstr("lr: 0.5"));
  EXPECT_THAT(text, HasSubstr("lr_scheduler: \"cosine\""));
  EXPECT_THAT(text, ::testing::Not(HasSubstr("n_layer")));
}

// The whole text (what runs save beside their checkpoints) reads back as the
// same run: no field whose presence matters is filled in with its default.
TEST(ConfigToTextTest, TheWholeTextReadsBackAsTheSameRun) {
  TrainerConfig llama;
  llama.set_model("llama");
  llama.set_n_layer(3);
  TrainerConfig script;
  script.set_model("torchscript:/tmp/model.pt");
  for (const TrainerConfig& config : {llama, script, TrainerConfig()}) {
    TrainerConfig again;
    ASSERT_TRUE(google::protobuf::TextFormat::ParseFromString(ConfigToText(config), &again));
    EXPECT_EQ(ModelComponent(again).first, ModelComponent(config).first);
    EXPECT_EQ(ModelComponent(again).second.values(), ModelComponent(config).second.values());
    auto plan = ResolveConfig(&again, again.dp());
    ASSERT_TRUE(plan.ok()) << plan.status();
    EXPECT_FALSE(plan->precision().loss_scaling());
  }
  EXPECT_EQ(ModelComponent(llama).second.GetString("preset", ""), "llama-tiny");
}

TEST(ConfigToTextTest, ChangesListOnlyWhatDiffersFromTheDefaults) {
  TrainerConfig c;
  c.set_lr(0.5);
  c.set_dp(2);  // set, but the default
  c.set_model("llama");
  c.mutable_model_config()->set_type("gpt");
  EXPECT_EQ(ConfigChangesToText(c), "model: \"llama\" lr: 0.5 model_config { type: \"gpt\" }");
  EXPECT_EQ(ConfigChangesToText(TrainerConfig()), "");
}

}  // namespace
}  // namespace trident
