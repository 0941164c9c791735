// ParallelModel on CUDA (needs a GPU; tagged gpu): parameters, batches and
// optimizer state on the rank's GPU, NCCL collectives (with CPU scalars staged
// through the GPU), and the losses of the same steps on CPU; bf16 and fp16
// autocast on the CUDA device type; the zoo's cached decoding on CUDA.
#include <cstdlib>
#include <fstream>

#include <gmock/gmock.h>
#include <gtest/gtest.h>
#include <torch/torch.h>

#include "models/models.h"
#include "parallel/parallel.h"
#include "testing/multiprocess.h"

namespace trident {
namespace {

struct NetImpl : torch::nn::Module {
  NetImpl() {
    torch::manual_seed(3);
    a = register_module("a", torch::nn::Linear(16, 32));
    b = register_module("b", torch::nn::Linear(32, 1));
  }
  torch::Tensor forward(const torch::Tensor& x) { return b(torch::gelu(a(x))); }
  torch::nn::Linear a{nullptr}, b{nullptr};
};

// Five AdamW steps of `precision` on `device`; the losses.
std::vector<double> Train(const std::string& device, const std::string& precision) {
  std::vector<double> losses;
  testing::RunOnRanks(1, [&](int) {
    TopologyOptions topology_options;
    topology_options.mesh_axes = {{"data", 1}};
    topology_options.backend = device == "cuda" ? CommBackend::kNccl : CommBackend::kGloo;
    topology_options.connect_one_rank_groups = device == "cuda";  // NCCL on one GPU
    auto topology = testing::JoinTopology(topology_options);
    ASSERT_TRUE(topology.ok()) << topology.status();
    auto net = std::make_shared<NetImpl>();
    ModelSource source = ModelSource::FromModule(net, [net](const Values& in) { return Values{net->forward(in[0])}; });
    source.loss = *LossRegistry().Find("mse");
    ParallelPlan plan;
    plan.set_device(device == "cuda" ? ParallelPlan::cuda : ParallelPlan::cpu);
    plan.mutable_precision()->set_mode(precision);
    plan.set_micro_batch_size(4);
    plan.set_num_micro_batches(2);
    plan.mutable_precision()->mutable_loss_scaler()->set_initial_scale_power(
        8);  // fp16: a scale its gradients fit from the first step
    torch::manual_seed(5);
    std::vector<Batch> batches = {{torch::randn({4, 16}), torch::randn({4, 1})},
                                  {torch::randn({4, 16}), torch::randn({4, 1})}};
    auto model = Parallelize(source, plan, topology->get(), batches[0], *MakeOptimizerFactory("adamw", {}));
    ASSERT_TRUE(model.ok()) << model.status();
    for (const auto& [name, p] : (*model)->parameters()) EXPECT_EQ(p.device().type(), at::Device(device).type());
    std::ofstream out(std::string(std::getenv("TEST_TMPDIR")) + "/" + device + precision);
    out.precision(17);
    for (int step = 0; step < 5; ++step) {
      (*model)->ZeroGrad();
      auto loss = (*model)->ForwardBackward(batches);
      ASSERT_TRUE(loss.ok()) << loss.status();
      auto skipped = (*model)->UnscaleGradients();  // fp16's loss scale
      ASSERT_TRUE(skipped.ok()) << skipped.status();
      EXPECT_FALSE(*skipped) << "step " << step << " overflowed at scale " << *(*model)->loss_scale();
      if (*skipped) continue;
      ASSERT_TRUE((*model)->ClipGradNorm(1.0).ok());
      ASSERT_TRUE((*model)->Step(1e-2).ok());
      out << *loss << "\n";
    }
  });
  std::ifstream in(std::string(std::getenv("TEST_TMPDIR")) + "/" + device + precision);
  for (double l; in >> l;) losses.push_back(l);
  return losses;
}

TEST(ParallelModelGpuTest, CudaStepsMatchCpu) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  const std::vector<double> cpu = Train("cpu", "fp32"), cuda = Train("cuda", "fp32");
  ASSERT_EQ(cuda.size(), 5u);
  for (size_t i = 0; i < cpu.size(); ++i) EXPECT_NEAR(cuda[i], cpu[i], 1e-4 * std::abs(cpu[i])) << i;
  for (const char* half : {"bf16", "fp16"}) {
    const std::vector<double> mixed = Train("cuda", half);
    ASSERT_EQ(mixed.size(), 5u) << half;
    EXPECT_NEAR(mixed.back(), cpu.back(), 0.05 * std::abs(cpu.back())) << half;
  }
}

// Decoding with the key/value cache on CUDA (fp32, attention through SDPA): a
// prompt, then one token at a time, gives the whole sequence's logits to
// rounding. The one-token products round differently from the whole
// sequence's, so text sampled both ways may part where two logits nearly tie;
// the logits are what must agree.
TEST(ModelsGpuTest, CachedDecodingComputesTheWholeSequencesLogits) {
  ASSERT_TRUE(torch::cuda::is_available()) << "run gpu-tagged tests on a machine with a GPU";
  for (const char* name : {"gpt", "llama"}) {
    SCOPED_TRACE(name);
    ModelConfig c = *PresetModelConfig(name, std::string(name) + "-tiny");
    c.n_layer = 2;
    auto model = *CreateModel(c, 1);
    model->to(torch::kCUDA);
    model->eval();
    torch::NoGradGuard no_grad;
    torch::manual_seed(0);
    auto tokens = torch::randint(c.vocab_size, {1, 64}, torch::kLong).to(torch::kCUDA);
    const at::Tensor whole = model->Logits(tokens);
    model->StartDecoding();
    std::vector<at::Tensor> pieces = {model->Logits(tokens.narrow(1, 0, 8))};
    for (int64_t t = 8; t < 64; ++t) pieces.push_back(model->Logits(tokens.narrow(1, t, 1)));
    model->StopDecoding();
    const double scale = 1 + whole.abs().max().item<double>();
    EXPECT_LE((torch::cat(pieces, 1) - whole).abs().max().item<double>(), 1e-4 * scale);
  }
}

}  // namespace
}  // namespace trident
