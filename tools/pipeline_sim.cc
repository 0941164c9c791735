// Simulates every pipeline schedule for given stage times and prints their step
// time and bubble fraction side by side; optionally draws each as an SVG and a
// Chrome trace.
//
//   pipeline_sim --stages=4 --micro_batches=8 --forward_ms=10 --backward_ms=20 --comm_ms=1 --out_dir=/tmp/s
//   pipeline_sim --stages=2 --forward_ms=10,14 --backward_ms=20,30 --recompute_ms=10
#include <gflags/gflags.h>

#include <cstdio>
#include <filesystem>
#include <fstream>

#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_split.h"
#include "base/flags_help.h"
#include "base/status.h"
#include "pipeline/pipeline.h"

DEFINE_int32(stages, 4, "pipeline stages");
DEFINE_int32(micro_batches, 8, "micro-batches per step");
DEFINE_string(forward_ms, "1", "forward time of a micro-batch: one value, or one per stage");
DEFINE_string(backward_ms, "2", "backward time of a micro-batch: one value, or one per stage");
DEFINE_string(recompute_ms, "0",
              "recomputation time of a micro-batch's checkpointed layers: one value, or one per stage");
DEFINE_double(comm_ms, 0, "time a message between stages takes");
DEFINE_int32(virtual_stages, 2, "model chunks per rank for interleaved_1f1b");
DEFINE_double(weight_grad_fraction, 0.5, "share of backward_ms that is weight gradients (zb_h1)");
DEFINE_string(out_dir, "", "write SCHEDULE.svg and SCHEDULE.json here");

namespace trident {
namespace {

absl::StatusOr<std::vector<double>> Seconds(const std::string& flag, const char* name) {
  std::vector<double> values;
  for (absl::string_view part : absl::StrSplit(flag, ',')) {
    double ms;
    if (!absl::SimpleAtod(part, &ms) || ms < 0) {
      return absl::InvalidArgumentError(absl::StrCat("--", name, "=", flag, " is not a list of non-negative numbers"));
    }
    values.push_back(ms / 1000);
  }
  return values;
}

absl::Status Run() {
  SimulationOptions options;
  options.num_stages = FLAGS_stages;
  options.num_micro_batches = FLAGS_micro_batches;
  TRIDENT_ASSIGN_OR_RETURN(options.forward_seconds, Seconds(FLAGS_forward_ms, "forward_ms"));
  TRIDENT_ASSIGN_OR_RETURN(options.backward_seconds, Seconds(FLAGS_backward_ms, "backward_ms"));
  TRIDENT_ASSIGN_OR_RETURN(options.recompute_seconds, Seconds(FLAGS_recompute_ms, "recompute_ms"));
  options.comm_seconds = FLAGS_comm_ms / 1000;
  options.weight_grad_fraction = FLAGS_weight_grad_fraction;
  std::printf("%d stages, %d micro-batches\n%-22s %14s %10s\n", FLAGS_stages, FLAGS_micro_batches, "schedule",
              "step_time_ms", "bubble");
  for (const std::string& name : ScheduleNames()) {
    const int chunks = name == "interleaved_1f1b" ? FLAGS_virtual_stages : 1;
    TRIDENT_ASSIGN_OR_RETURN(auto schedule, MakeSchedule(name, chunks));
    const std::string label = chunks > 1 ? absl::StrCat(name, " (", chunks, ")") : name;
    auto simulated = Simulate(*schedule, options);
    if (!simulated.ok()) {
      std::printf("%-22s refused: %s\n", label.c_str(), std::string(simulated.status().message()).c_str());
      continue;
    }
    const SimulationResult& result = *simulated;
    std::printf("%-22s %14.3f %9.1f%%\n", label.c_str(), result.makespan * 1000, 100 * result.bubble_fraction);
    if (!FLAGS_out_dir.empty()) {
      std::filesystem::create_directories(FLAGS_out_dir);
      std::ofstream(FLAGS_out_dir + "/" + name + ".svg") << TimelineSvg(
          result.events, absl::StrCat(name, ": ", FLAGS_stages, " stages, ", FLAGS_micro_batches, " micro-batches"));
      std::ofstream(FLAGS_out_dir + "/" + name + ".json") << ChromeTraceJson(result.events);
    }
  }
  return absl::OkStatus();
}

}  // namespace
}  // namespace trident

int main(int argc, char** argv) {
  gflags::SetUsageMessage(
      "pipeline_sim --stages=S --micro_batches=M --forward_ms=F --backward_ms=B [--out_dir=DIR]: every schedule's "
      "timeline and bubble");
  if (trident::HelpRequested(argc, argv)) return trident::PrintHelp(__FILE__);
  gflags::ParseCommandLineFlags(&argc, &argv, true);
  return trident::ExitCodeFor("pipeline_sim", trident::Run());
}
