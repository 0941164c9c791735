// LoRA fine-tuning through the Trainer: from a base model (init_from), every
// layout, with and without recomputation, trains the losses of one process;
// the base weights stay as they were; exports are PEFT's adapter or the
// merged model; checkpoints hold the adapter alone and resume exactly.
#include <filesystem>
#include <fstream>
#include <set>

#include <ATen/ATen.h>
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "checkpoint/checkpoint.h"
#include "lora/lora.h"
#include "testing/multiprocess.h"
#include "trainer/internal/training_runs.h"
#include "trainer/trainer.h"

namespace trident {
namespace {

namespace fs = std::filesystem;
using testing::ExpectSameLosses;
using testing::SetFlag;
using testing::SmallConfig;
using testing::TestDir;
using testing::TrainOnRanks;

constexpr double kScale = 8.0 / 4.0;  // alpha / r below

// A base model: gpt-tiny (2 layers of width 64) trained 5 steps and exported.
std::string BaseModel() {
  const std::string path = TestDir() + "/lora_base/model.safetensors";
  TrainerConfig base = SmallConfig(1);
  base.mutable_loop()->set_max_steps(5);
  base.mutable_checkpoint()->set_export_safetensors(path);
  TrainOnRanks(base, "lora_base");
  return path;
}

// SmallConfig(dp) fine-tuning the base with adapters of rank 4 on every linear layer of the blocks.
TrainerConfig LoraConfig(int dp, const std::string& base) {
  const std::string file = TestDir() + "/lora.pbtxt";
  if (!testing::IsRankProcess()) {
    std::ofstream(file) << "r: 4\nalpha: 8\ntarget_modules: \"c_attn\"\ntarget_modules: \"c_proj\"\n"
                           "target_modules: \"c_fc\"\n";
  }
  TrainerConfig config = SmallConfig(dp);
  SetFlag(&config, "lora_config", file);
  config.mutable_checkpoint()->set_init_from(base);
  return config;
}

SafetensorsContents Read(const std::string& path) {
  auto contents = ReadSafetensors(path);
  EXPECT_TRUE(contents.ok()) << contents.status();
  return contents.ok() ? *std::move(contents) : SafetensorsContents();
}

TEST(LoraTrainingTest, EveryLayoutTrainsTheLossesOfOneProcess) {
  const std::string base = BaseModel();
  const std::vector<double> single = TrainOnRanks(LoraConfig(1, base), "lora_single");
  ASSERT_EQ(single.size(), 20u);
  EXPECT_LT(single.back(), single.front()) << "the adapters should learn";
  struct Layout {
    int dp, tp, pp;
    bool sequence_parallel;
    int zero_stage;
    const char* recompute = "none";  // activation_checkpointing, or "modules": attention and MLP
  };
  for (const Layout& l : {Layout{2, 1, 1, false, 0}, Layout{1, 2, 1, false, 0}, Layout{1, 2, 1, true, 0},
                          Layout{1, 1, 2, false, 0}, Layout{2, 1, 1, false, 1}, Layout{2, 1, 1, false, 3},
                          Layout{2, 1, 1, false, 0, "full"}, Layout{2, 1, 1, false, 3, "modules"},
                          Layout{1, 2, 1, true, 0, "full"}, Layout{1, 1, 2, false, 0, "stage_aware"}}) {
    TrainerConfig config = LoraConfig(l.dp, base);
    config.mutable_plan()->set_tp(l.tp);
    config.mutable_plan()->set_pp(l.pp);
    config.mutable_plan()->mutable_tensor_parallel()->set_sequence_parallel(l.sequence_parallel);
    config.mutable_plan()->mutable_zero()->set_stage(l.zero_stage);
    config.mutable_plan()->set_micro_batch_size(l.pp > 1 ? 2 : 8 / l.dp);
    if (std::string(l.recompute) == "modules") {
      SetFlag(&config, "checkpoint_modules", "attn,mlp");
    } else {
      SetFlag(&config, "activation_checkpointing", l.recompute);
    }
    const std::string tag = absl::StrCat("lora_dp", l.dp, "_tp", l.tp, l.sequence_parallel ? "sp" : "", "_pp", l.pp,
                                         "_zero", l.zero_stage, "_recompute_", l.recompute);
    SCOPED_TRACE(tag);
    ExpectSameLosses(single, TrainOnRanks(config, tag), 1e-5);
  }
}

// One process: only the adapters change and hold optimizer state; the PEFT
// export holds them, the merged export is W + scale * B A.
TEST(LoraTrainingTest, TheBaseStaysAndExportsAreTheAdapterOrTheMergedModel) {
  const std::string base_path = BaseModel();
  const std::string adapter_path = TestDir() + "/lora_export/adapter.safetensors";
  const std::string merged_path = TestDir() + "/lora_export/merged.safetensors";
  TrainerConfig config = LoraConfig(1, base_path);
  config.mutable_loop()->set_max_steps(5);
  config.mutable_checkpoint()->set_export_safetensors(adapter_path);
  testing::RunOnRanks(1, [&](int) {
    auto topology = testing::JoinTopology();
    ASSERT_TRUE(topology.ok());
    auto trainer = Trainer::Create(config, topology->get());
    ASSERT_TRUE(trainer.ok()) << trainer.status();
    ASSERT_TRUE((*trainer)->Train().ok());
    const SafetensorsContents base = Read(base_path);
    int64_t trainable = 0, frozen = 0;
    for (const auto& [name, p] : (*trainer)->model().parameters()) {
      if (p.requires_grad()) {
        EXPECT_TRUE(IsAdapterParameter(name)) << name;
        trainable += p.numel();
        continue;
      }
      ++frozen;
      auto initial = base.Get(name);
      ASSERT_TRUE(initial.ok()) << name;
      EXPECT_TRUE(at::equal(p, *initial)) << name << " changed";
    }
    EXPECT_EQ(frozen, static_cast<int64_t>(base.tensors.size()) - 1);  // lm_head.weight is wte's alias
    // 2 layers x (c_attn 4x64 + 192x4, attn c_proj 4x64 + 64x4, c_fc 4x64 + 256x4, mlp c_proj 4x256 + 64x4)
    EXPECT_EQ(trainable, 2 * ((256 + 768) + (256 + 256) + (256 + 1024) + (1024 + 256)));
    const MemoryReport memory = (*trainer)->model().Memory();
    EXPECT_EQ(memory.optimizer_bytes, 2 * 4 * trainable) << "AdamW's two moments, for the adapters only";
    EXPECT_EQ(memory.gradient_bytes, 4 * trainable);
    std::printf("LoRA memory: %s (%lld trainable parameters)\n", memory.ToString().c_str(),
                static_cast<long long>(trainable));
  });
  TrainerConfig merged = config;
  merged.mutable_checkpoint()->set_export_safetensors(merged_path);
  merged.mutable_checkpoint()->set_lora_merge_on_export(true);
  TrainOnRanks(merged, "lora_merged");

  const SafetensorsContents base = Read(base_path), adapter = Read(adapter_path), model = Read(merged_path);
  ASSERT_EQ(adapter.tensors.size(), 16u);  // A and B of 4 layers in each of 2 blocks
  for (const auto& [name, t] : adapter.tensors) {
    EXPECT_TRUE(absl::StartsWith(name, "base_model.model.transformer.h.")) << name;
    EXPECT_TRUE(absl::EndsWith(name, ".lora_A.default.weight") || absl::EndsWith(name, ".lora_B.default.weight"))
        << name;
  }
  ASSERT_EQ(model.tensors.size(), base.tensors.size());
  int merged_layers = 0;
  for (const auto& [name, w] : base.tensors) {
    auto got = model.Get(name);
    ASSERT_TRUE(got.ok()) << name;
    const std::string layer = name.substr(0, name.rfind('.'));
    auto a = adapter.Get("base_model.model." + layer + ".lora_A.default.weight");
    auto b = adapter.Get("base_model.model." + layer + ".lora_B.default.weight");
    if (!a.ok() || !absl::EndsWith(name, ".weight")) {
      EXPECT_TRUE(at::equal(*got, w)) << name << " is not adapted and must be the base's";
      continue;
    }
    ++merged_layers;
    EXPECT_GT(b->abs().max().item<double>(), 0) << "B trained away from zero";
    const at::Tensor expected = w + kScale * at::mm(*b, *a);
    EXPECT_LE((*got - expected).abs().max().item<double>(), 1e-6) << name;
  }
  EXPECT_EQ(merged_layers, 8);
}

TEST(LoraTrainingTest, CheckpointsHoldTheAdapterAloneAndResumeExactly) {
  const std::string base = BaseModel();
  const std::string save_dir = TestDir() + "/lora_resume";
  if (!testing::IsRankProcess()) fs::remove_all(save_dir);
  TrainerConfig straight = LoraConfig(2, base);
  straight.mutable_checkpoint()->set_save_dir(save_dir);
  straight.mutable_checkpoint()->set_save_every(10);
  const std::vector<double> losses = TrainOnRanks(straight, "lora_straight");
  auto reader = CheckpointReader::Open(save_dir + "/step_10");
  ASSERT_TRUE(reader.ok()) << reader.status();
  std::set<std::string> parameters;
  for (const auto& [name, shape] : (*reader)->FullShapes()) {
    if (absl::StartsWith(name, "optimizer/")) {
      EXPECT_TRUE(IsAdapterParameter(name.substr(10, name.rfind('/') - 10))) << name;
    } else if (!absl::StartsWith(name, "rng/") && !absl::StartsWith(name, "trainer/")) {
      parameters.insert(name);
    }
  }
  EXPECT_EQ(parameters.size(), 16u);
  for (const std::string& name : parameters) EXPECT_TRUE(IsAdapterParameter(name)) << name;

  TrainerConfig resumed = straight;
  resumed.mutable_checkpoint()->set_resume_from(save_dir + "/step_10");
  resumed.mutable_checkpoint()->set_save_dir(TestDir() + "/lora_resume_again");
  const std::vector<double> tail = TrainOnRanks(resumed, "lora_resumed");
  ASSERT_EQ(tail.size(), 10u);
  for (size_t i = 0; i < tail.size(); ++i) EXPECT_EQ(tail[i], losses[10 + i]) << "step " << 11 + i;
}

}  // namespace
}  // namespace trident
