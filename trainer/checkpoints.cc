// Checkpoints, init_from, exports and pipeline traces of the Trainer.
#include <filesystem>
#include <fstream>
#include <sstream>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "base/rng.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "pipeline/pipeline.h"
#include "trainer/internal/trainer_impl.h"

namespace trident {
namespace {

namespace fs = std::filesystem;

constexpr char kModel[] = "model/";
constexpr char kState[] = "state/";  // optimizer and loss-scaler state
constexpr char kRng[] = "rng/cpu";

}  // namespace

absl::Status Trainer::Impl::LoadInitialWeights(const std::string& path) {
  TRIDENT_ASSIGN_OR_RETURN(SafetensorsContents contents, ReadSafetensors(path));
  contents.path = absl::StrCat("init_from ", path);
  return model->LoadWeights(contents);
}

absl::Status Trainer::Impl::SaveCheckpoint() {
  CheckpointDirectory directory(config.save_dir());
  TRIDENT_ASSIGN_OR_RETURN(const std::string staging, directory.StagingPath(step));
  NamedTensors tensors;
  TRIDENT_RETURN_IF_ERROR(model->GatherFullParameters());
  for (const auto& [name, p] : model->parameters()) tensors.emplace_back(kModel + name, p.detach().cpu());
  for (const auto& [name, t] : model->State()) tensors.emplace_back(kState + name, t.cpu());
  tensors.emplace_back(kRng, CpuRngState());
  absl::Status written = WriteSafetensors(
      absl::StrCat(staging, "/rank_", topology().rank(), ".safetensors"), tensors,
      {{"step", absl::StrCat(step)}, {"rank", absl::StrCat(topology().rank())}});
  TRIDENT_RETURN_IF_ERROR(model->ReleaseFullParameters(/*keep_changes=*/false));
  TRIDENT_RETURN_IF_ERROR(written);
  if (is_rank0()) std::ofstream(staging + "/config.pbtxt") << ConfigToText(config);
  TRIDENT_RETURN_IF_ERROR(topology().world().Barrier());
  if (is_rank0()) {
    TRIDENT_RETURN_IF_ERROR(
        directory.Commit(step, topology().world_size(), last_val_loss, config.keep_last_n()));
  }
  TRIDENT_RETURN_IF_ERROR(topology().world().Barrier());
  const std::string path = absl::StrCat(config.save_dir(), "/step_", step);
  Print(absl::StrCat("saved checkpoint ", path));
  ForHooks([&](TrainerHooks& h) { h.OnSaveCheckpoint(State(), path); });
  return absl::OkStatus();
}

absl::Status Trainer::Impl::LoadCheckpoint() {
  CheckpointDirectory directory(config.save_dir());
  auto resolved = directory.Resolve(config.resume_from());
  if (!resolved.ok()) {
    const bool nothing_saved_yet = config.resume_from() == "last" &&
                                   absl::IsNotFound(resolved.status()) &&
                                   !fs::exists(config.save_dir() + "/last");
    if (!nothing_saved_yet) return resolved.status();
    Print(absl::StrCat("no checkpoint in ", config.save_dir(), " yet; starting from step 0"));
    return absl::OkStatus();
  }
  for (const std::string& reason : resolved->skipped) {
    Print(absl::StrCat("resume_from=last: skipping an invalid checkpoint: ", reason));
  }
  if (resolved->manifest.world_size() != topology().world_size()) {
    return absl::FailedPreconditionError(absl::StrCat(
        "checkpoint ", resolved->path, " was written by ", resolved->manifest.world_size(),
        " ranks but this run has ", topology().world_size(),
        "; resume with the same layout (resharding across layouts is not available yet)"));
  }
  const std::string file = absl::StrCat(resolved->path, "/rank_", topology().rank(), ".safetensors");
  TRIDENT_ASSIGN_OR_RETURN(SafetensorsContents contents, ReadSafetensors(file));
  SafetensorsContents weights;
  weights.path = file;
  NamedTensors state;
  for (const auto& [name, t] : contents.tensors) {
    if (name.rfind(kModel, 0) == 0) weights.tensors.emplace_back(name.substr(sizeof(kModel) - 1), t);
    if (name.rfind(kState, 0) == 0) state.emplace_back(name.substr(sizeof(kState) - 1), t);
  }
  TRIDENT_RETURN_IF_ERROR(model->LoadWeights(weights));
  TRIDENT_RETURN_IF_ERROR(model->LoadState(state));
  TRIDENT_ASSIGN_OR_RETURN(at::Tensor rng, contents.Get(kRng));
  SetCpuRngState(rng);
  step = resolved->manifest.step();
  if (resolved->manifest.has_val_loss()) last_val_loss = resolved->manifest.val_loss();
  Print(absl::StrCat("resumed from ", resolved->path, " at step ", step));
  ForHooks([&](TrainerHooks& h) { h.OnLoadCheckpoint(State(), resolved->path); });
  return absl::OkStatus();
}

absl::Status Trainer::Impl::ExportSafetensors(const std::string& path) {
  TRIDENT_ASSIGN_OR_RETURN(NamedTensors tensors, model->FullWeights());
  if (!is_rank0()) return absl::OkStatus();
  const auto parent = fs::path(path).parent_path();
  std::error_code error;
  if (!parent.empty()) fs::create_directories(parent, error);
  TRIDENT_RETURN_IF_ERROR(WriteSafetensors(path, tensors, {{"format", "pt"}}));
  Print(absl::StrCat("exported the model to ", path));
  return absl::OkStatus();
}

// Every rank's timeline (and operators) reach rank 0 through the process
// group; rank 0 writes the Chrome trace and the SVG picture, one row per rank.
absl::Status Trainer::Impl::WriteTrace(const std::vector<internal::OperatorEvent>* operators) {
  const int rank = topology().rank();
  std::ostringstream timeline;
  timeline.precision(9);
  for (const TimelineEvent& e : model->timeline()) {
    timeline << static_cast<int>(e.op) << " " << e.micro_batch << " " << e.chunk << " " << e.start << " " << e.end
             << "\n";
  }
  const std::string ops = operators == nullptr ? ""
                                               : internal::OperatorTraceEvents(*operators, /*pid=*/0, 1000 * (rank + 1),
                                                                               absl::StrCat("rank ", rank, " operators"));
  TRIDENT_ASSIGN_OR_RETURN(std::vector<std::vector<std::string>> gathered,
                           AllGatherStrings(topology().world(), {timeline.str(), ops}));
  if (is_rank0()) {
    std::vector<TimelineEvent> events;
    std::string more;
    for (int r = 0; r < static_cast<int>(gathered.size()); ++r) {
      std::istringstream in(gathered[r][0]);
      TimelineEvent e;
      int op;
      while (in >> op >> e.micro_batch >> e.chunk >> e.start >> e.end) {
        e.stage = r;
        e.op = static_cast<Op>(op);
        events.push_back(e);
      }
      if (!gathered[r][1].empty()) absl::StrAppend(&more, more.empty() ? "" : ",\n", gathered[r][1]);
    }
    std::error_code error;
    const fs::path parent = fs::path(config.trace_file()).parent_path();
    if (!parent.empty()) fs::create_directories(parent, error);
    std::ofstream(config.trace_file()) << ChromeTraceJson(events, more);
    if (!events.empty()) {
      std::ofstream(fs::path(config.trace_file()).replace_extension(".svg"))
          << TimelineSvg(events, absl::StrCat(config.schedule(), ", step ", config.trace_step(), ", ",
                                              topology().world_size(), " ranks (row = rank)"));
    }
    Print(absl::StrCat("wrote the ", operators ? "operators and " : "", "timeline of step ", config.trace_step(),
                       " to ", config.trace_file()));
  }
  return absl::OkStatus();
}

}  // namespace trident
