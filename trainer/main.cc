// train: trains a registered model (the zoo's, a TorchScript file, or one a
// binary linked with its own registrations adds) with Trident.
//
//   bazel run -c opt //trainer:train                      # gpt-tiny on fortunes, 2 local ranks
//   bazel run -c opt //trainer:train -- --config=trainer/configs/default.pbtxt --lr=3e-4
//   train --model=torchscript:gpt.pt --block_size=64 --dp=2 --pp=2
//   launch --nproc_per_node=4 -- train --dp=4             # under a launcher, mpirun or srun
//
// A user's binary with its own models, datasets or losses registered links
// //trainer:train_main and its registrations, and takes the same flags.
// Every TrainerConfig field (trainer/config.proto) is a flag by its dotted
// name (--loop.lr), and the flat flags of earlier versions (--lr) are aliases.
// Started without RANK in the environment, train spawns dp*tp*pp local ranks
// (or --nproc) itself and exits non-zero if any of them fails.
#include <dlfcn.h>
#include <gflags/gflags.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include <ATen/Parallel.h>

#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "base/flags_help.h"
#include "base/status.h"
#include "kernels/kernels.h"
#include "topology/topology.h"
#include "trainer/trainer.h"

DEFINE_string(config, "", "a TrainerConfig text file; flags override its fields");
DEFINE_int32(nproc, 0, "local ranks to spawn when not started by a launcher (0: dp*tp*pp)");

namespace trident {
namespace internal {
extern const unsigned char kTrainerConfigDescriptor[];
extern const size_t kTrainerConfigDescriptorSize;
}  // namespace internal
namespace {

absl::StatusOr<TrainerConfig> ConfigFromCommandLine(int* argc, char*** argv) {
  std::vector<std::string> args(*argv + 1, *argv + *argc);
  TrainerConfig overrides;
  TRIDENT_RETURN_IF_ERROR(ApplyConfigFlags(&args, &overrides));
  // What is left are the binary's own flags (and gflags' --help family).
  for (const std::string& arg : args) {
    const std::string name = arg.substr(0, arg.find('=')).substr(arg.rfind("--", 0) == 0 ? 2 : 0);
    gflags::CommandLineFlagInfo info;
    if (arg.rfind("--", 0) == 0 && !gflags::GetCommandLineFlagInfo(name.c_str(), &info)) {
      return absl::InvalidArgumentError(absl::StrCat("unknown flag --", name,
                                                     "; the flags are the fields of trainer/config.proto, "
                                                     "--config and --nproc"));
    }
  }
  std::vector<char*> rest = {(*argv)[0]};
  static std::vector<std::string> storage;
  storage = args;
  for (std::string& a : storage) rest.push_back(a.data());
  int rest_count = static_cast<int>(rest.size());
  char** rest_argv = rest.data();
  gflags::ParseCommandLineFlags(&rest_count, &rest_argv, /*remove_flags=*/true);
  if (rest_count > 1) {
    return absl::InvalidArgumentError(absl::StrCat("unexpected argument '", rest_argv[1], "'; flags are --name=value"));
  }
  TrainerConfig config = DefaultTrainerConfig();
  if (!FLAGS_config.empty()) {
    TRIDENT_ASSIGN_OR_RETURN(config, LoadTrainerConfig(FLAGS_config));
  }
  std::vector<std::string> again(*argv + 1, *argv + *argc);
  TRIDENT_RETURN_IF_ERROR(ApplyConfigFlags(&again, &config));
  return config;
}

// `blas_note`: what UseBestBlasKernels changed, printed by rank 0.
absl::Status RunRank(TrainerConfig config, const std::string& blas_note) {
  // From the start, so that a SIGTERM while the job starts up also ends in a
  // checkpoint after the first step rather than in a killed rank.
  if (config.runtime().preempt_save()) StopOnSigterm();
  TRIDENT_ASSIGN_OR_RETURN(DistributedEnv env, DistributedEnvFromEnvironment());
  if (RestartCount() > 0 && !config.checkpoint().save_dir().empty() && config.checkpoint().resume_from().empty()) {
    config.mutable_checkpoint()->set_resume_from("last");  // a restarted job goes on from its newest valid checkpoint
  }
  // The configuration is resolved once, here; the plan is the layout from now on.
  TRIDENT_ASSIGN_OR_RETURN(ParallelPlan plan, ResolveConfig(&config, env.world_size));
  if (!blas_note.empty() && env.rank == 0) std::printf("%s\n", blas_note.c_str());
  // The layout's own dp (--dp, --plan.dp or a loaded strategy's), which elastic replaced.
  TRIDENT_ASSIGN_OR_RETURN(const int layout_ranks, ConfigWorldSize(config));
  const int layout_dp = layout_ranks / (plan.tp() * plan.pp());
  if (config.runtime().elastic() && plan.dp() != layout_dp && env.rank == 0) {
    std::printf(
        "elastic: %d ranks, so dp=%d instead of %d (tp=%d and pp=%d kept; global batch %lld in %lld "
        "accumulation steps)\n",
        env.world_size, plan.dp(), layout_dp, plan.tp(), plan.pp(), static_cast<long long>(GlobalBatchSize(plan)),
        static_cast<long long>(plan.num_micro_batches()));
  }
  // This rank's share of the cores (CpuThreadsPerRank: Slurm's cpus per task,
  // or the CPUs this process may use over the node's ranks) goes to the pool that runs its matrix
  // products (see config.proto's intra_op_threads): on CPU they run in oneDNN
  // on ATen's intra-op threads (fp32 through UseOneDnnProducts, bf16 in
  // LibTorch's own oneDNN path), with a BLAS pool of one; where fp32 products
  // stay in OpenBLAS, they run on its pool (OPENBLAS_NUM_THREADS, set by the
  // launcher; set here at run time under mpirun or srun) with one intra-op
  // thread, as the two pools slow each other down.
  const int share = CpuThreadsPerRank(env);
  const bool onednn_products = plan.device() != ParallelPlan::cuda &&
                               (UseOneDnnProducts() || absl::StrContains(plan.precision().mode(), "bf16"));
  if (std::getenv("OPENBLAS_NUM_THREADS") == nullptr) {
    using SetThreads = void (*)(int);
    if (auto set = reinterpret_cast<SetThreads>(dlsym(RTLD_DEFAULT, "openblas_set_num_threads"))) {
      set(onednn_products ? 1 : share);
    }
  }
  // OMP_NUM_THREADS, the user's or the launcher's share, sizes the oneDNN pool.
  const char* omp_threads = std::getenv("OMP_NUM_THREADS");
  const int pool = omp_threads != nullptr && std::atoi(omp_threads) > 0 ? std::atoi(omp_threads) : share;
  at::set_num_threads(config.runtime().intra_op_threads() > 0 ? config.runtime().intra_op_threads()
                      : onednn_products                       ? pool
                                                              : 1);
  TuneAllocatorForTraining(/*sharded_parameters=*/plan.zero().stage() == 3);
  TopologyOptions options;
  if (config.strategy().search().empty()) {  // else the search lays the ranks out
    options.mesh_axes = PlanMeshAxes(plan);
    options.rank_order = ToVector(plan.rank_order());
  }
  options.backend = plan.device() == ParallelPlan::cuda ? CommBackend::kNccl : CommBackend::kGloo;
  options.timeout = absl::Seconds(config.runtime().collective_timeout_s());
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<Topology> topology, Topology::Create(env, options));
  if (!config.strategy().search().empty()) {
    const bool compile_only = config.strategy().run_mode() == "compile";
    TRIDENT_ASSIGN_OR_RETURN(plan, Trainer::ChooseStrategy(config, std::move(plan), topology.get()));
    if (compile_only) return absl::OkStatus();
  }
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<Trainer> trainer,
                           Trainer::Create(std::move(config), std::move(plan), topology.get()));
  return trainer->Train().status();
}

absl::Status Run(int argc, char** argv) {
  // Before any product runs; the ranks the launcher starts inherit the choice
  // (OPENBLAS_CORETYPE).
  const std::string blas_note = UseBestBlasKernels();
  TRIDENT_ASSIGN_OR_RETURN(TrainerConfig config, ConfigFromCommandLine(&argc, &argv));
  if (HasDistributedEnv()) return RunRank(config, blas_note);
  int nproc = FLAGS_nproc;
  if (nproc <= 0) {
    TRIDENT_ASSIGN_OR_RETURN(nproc, ConfigWorldSize(config));
  }
  // Check the configuration once, here, before any rank starts.
  TRIDENT_RETURN_IF_ERROR(Trainer::Preflight(config, nproc));
  if (!blas_note.empty()) std::printf("%s\n", blas_note.c_str());
  if (isatty(STDOUT_FILENO)) setenv("TRIDENT_STDOUT_IS_TTY", "1", /*overwrite=*/0);
  LaunchOptions launch;
  launch.max_restarts = config.runtime().max_restarts();
  launch.signal_grace = absl::Seconds(config.runtime().preempt_grace_s());
  return *RunAsLocalJobUnlessLaunched(nproc, argc, argv, launch);
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "train [--config=FILE] [--GROUP.FIELD=VALUE ...]: every field of TrainerConfig (trainer/config.proto) is a "
      "flag by its dotted name; the flat flags of earlier versions (--lr, --dp, ...) are aliases");
  if (trident::HelpRequested(argc, argv)) {
    const trident::TrainerConfig defaults = trident::DefaultTrainerConfig();
    auto fields = trident::MessageFlagsHelp(trident::internal::kTrainerConfigDescriptor,
                                            trident::internal::kTrainerConfigDescriptorSize, "trident.TrainerConfig",
                                            {&defaults, trident::ConfigFlagAliases()});
    if (!fields.ok()) return trident::ExitCodeFor("train", fields.status());
    return trident::PrintHelp(__FILE__, *fields);
  }
  return trident::ExitCodeFor("train", trident::Run(argc, argv));
}
