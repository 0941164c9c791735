// Trains SkipNet through Trident's C++ API: Parallelize the model, then run
// the trainer's loop over it and the dataset. Started without a launcher it
// spawns dp*pp local ranks itself.
//
//   bazel run -c opt //skipnet:train_skipnet -- --dp=2 --pp=2 --zero_stage=1
#include <gflags/gflags.h>

#include "base/status.h"
#include "kernels/kernels.h"
#include "parallel/parallel.h"
#include "skipnet/skipnet.h"
#include "topology/topology.h"
#include "trainer/trainer.h"

DEFINE_int32(dp, 2, "data-parallel ranks");
DEFINE_int32(pp, 1, "pipeline stages");
DEFINE_int32(zero_stage, 0, "ZeRO stage (0-3)");
DEFINE_int32(steps, 60, "optimizer steps");
DEFINE_string(schedule, "1f1b", "pipeline schedule");

namespace {

absl::Status Train() {
  trident::TopologyOptions options;
  options.mesh_axes = {{"pipeline", FLAGS_pp}, {"data", FLAGS_dp}};
  TRIDENT_ASSIGN_OR_RETURN(auto topology, trident::Topology::CreateFromEnvironment(options));

  auto train = std::make_unique<skipnet::ShapesDataset>(512, /*seed=*/1);
  auto val = std::make_unique<skipnet::ShapesDataset>(128, /*seed=*/2);
  trident::ParallelPlan plan;
  plan.set_dp(FLAGS_dp);
  plan.set_pp(FLAGS_pp);
  plan.mutable_pipeline()->set_schedule(FLAGS_schedule);
  plan.mutable_zero()->set_stage(FLAGS_zero_stage);
  plan.set_micro_batch_size(4);
  plan.set_num_micro_batches(16 / (4 * FLAGS_dp));
  for (const std::string& field : train->field_names()) plan.mutable_trace()->add_batch_fields(field);
  TRIDENT_ASSIGN_OR_RETURN(trident::Batch example, train->Get({0, 1, 2, 3}));
  TRIDENT_ASSIGN_OR_RETURN(trident::OptimizerFactory adamw,
                           trident::MakeOptimizerFactory("adamw", trident::ComponentArgs()));
  TRIDENT_ASSIGN_OR_RETURN(auto model,
                           trident::Parallelize(skipnet::Source(/*seed=*/7), plan, topology.get(), example, adamw));

  trident::TrainerConfig config = trident::DefaultTrainerConfig();  // the loop; the layout comes from the plan
  config.mutable_loop()->set_max_steps(FLAGS_steps);
  config.mutable_loop()->set_lr(3e-3);
  config.mutable_loop()->set_warmup_steps(5);
  config.mutable_loop()->set_eval_every(20);
  config.mutable_loop()->set_eval_steps(4);
  config.mutable_output()->set_log_every(10);
  TRIDENT_ASSIGN_OR_RETURN(auto trainer,
                           trident::Trainer::Create(config, {std::move(model), std::move(train), std::move(val)}));
  return trainer->Train().status();
}

}  // namespace

int main(int argc, char** argv) {
  gflags::ParseCommandLineFlags(&argc, &argv, /*remove_flags=*/false);
  // The fastest fp32 CPU products: a process-wide choice, so the program
  // makes it (no Trident call does), before any product runs.
  trident::UseBestCpuKernels();
  if (auto spawned = trident::RunAsLocalJobUnlessLaunched(FLAGS_dp * FLAGS_pp, argc, argv)) {
    return trident::ExitCodeFor("train_skipnet", *spawned);
  }
  return trident::ExitCodeFor("train_skipnet", Train());
}
