// Checkpoints, init_from, exports and pipeline traces of the Trainer.
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <ATen/ATen.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/rng.h"
#include "base/status.h"
#include "checkpoint/checkpoint.h"
#include "pipeline/pipeline.h"
#include "trainer/internal/trainer_impl.h"

namespace trident {
namespace {

namespace fs = std::filesystem;

std::string RngName(int rank) { return absl::StrCat("rng/rank_", rank); }

}  // namespace

absl::Status Trainer::Impl::LoadInitialWeights(const std::string& path) {
  if (fs::is_directory(path)) {  // a checkpoint of any layout: its weights
    TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(path));
    return model->LoadCheckpointPieces(*reader, /*optimizer=*/false);
  }
  TRIDENT_ASSIGN_OR_RETURN(SafetensorsContents contents, ReadSafetensors(path));
  contents.path = absl::StrCat("init_from ", path);
  return model->LoadWeights(contents);
}

namespace {

double SecondsSince(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

// "<code>:<message>" and back: a status through the store.
std::string EncodeStatus(const absl::Status& status) {
  return status.ok() ? "" : absl::StrCat(static_cast<int>(status.code()), ":", status.message());
}
absl::Status DecodeStatus(const std::string& text) {
  if (text.empty()) return absl::OkStatus();
  const size_t colon = text.find(':');
  return absl::Status(static_cast<absl::StatusCode>(std::atoi(text.substr(0, colon).c_str())), text.substr(colon + 1));
}

// A save's work after the snapshot: this rank's writes, then the agreement
// through the store. Every rank reports the checksums of its files (counters
// crc/<file> and size/<file>, plus one) or its error (error_<rank>), then
// counts itself in `reported`; rank 0 commits when all reported without error
// and publishes the verdict (counter `decided`, and `verdict` when it failed).
// Counters, because they are fast to poll. Runs on the background thread with
// async_save; the verdict is the same on every rank.
struct CheckpointJob {
  // Writes files into the staging directory, recording their checksums.
  using Write = std::function<absl::Status(const std::string& staging, std::map<std::string, Checksum>* written)>;
  std::vector<Write> writes;       // this rank's
  std::vector<std::string> files;  // every file of the checkpoint
  std::string save_dir;
  int64_t step = 0;
  std::optional<double> val_loss;
  int keep_last_n = 0;
  int rank = 0;
  int world_size = 1;
  std::string key;  // this save's prefix in the store
  absl::Duration timeout;

  absl::Status Run(StoreClient& store, const std::atomic<bool>& cancelled) const {
    const CheckpointDirectory directory(save_dir);
    absl::StatusOr<std::string> staging = directory.StagingPath(step);
    absl::Status written = staging.status();
    std::map<std::string, Checksum> checksums;
    for (const Write& write : writes) {
      if (written.ok()) written = write(*staging, &checksums);
    }
    if (written.ok()) {
      for (const auto& [name, checksum] : checksums) {
        TRIDENT_RETURN_IF_ERROR(store.Add(key + "crc/" + name, int64_t{checksum.crc32} + 1).status());
        TRIDENT_RETURN_IF_ERROR(store.Add(key + "size/" + name, checksum.size + 1).status());
      }
    } else {
      TRIDENT_RETURN_IF_ERROR(store.Set(absl::StrCat(key, "error_", rank), EncodeStatus(written)));
    }
    TRIDENT_RETURN_IF_ERROR(store.Add(key + "reported", 1).status());
    if (rank == 0) {
      const absl::Status verdict = Decide(store, cancelled, directory);
      if (!verdict.ok() && staging.ok()) {
        std::error_code error;
        std::filesystem::remove_all(*staging, error);  // the previous checkpoint stays `last`
      }
      if (!verdict.ok()) TRIDENT_RETURN_IF_ERROR(store.Set(key + "verdict", EncodeStatus(verdict)));
      TRIDENT_RETURN_IF_ERROR(store.Add(key + "decided", 1).status());
    }
    TRIDENT_RETURN_IF_ERROR(AwaitCount(store, cancelled, "decided", 1));
    TRIDENT_ASSIGN_OR_RETURN(const bool failed, store.Contains(key + "verdict"));
    if (!failed) return absl::OkStatus();
    TRIDENT_ASSIGN_OR_RETURN(const std::string verdict, store.Get(key + "verdict"));
    return DecodeStatus(verdict);
  }

 private:
  // Rank 0: the first rank's error, else the commit of what the ranks reported.
  absl::Status Decide(StoreClient& store, const std::atomic<bool>& cancelled,
                      const CheckpointDirectory& directory) const {
    TRIDENT_RETURN_IF_ERROR(AwaitCount(store, cancelled, "reported", world_size));
    for (int r = 0; r < world_size; ++r) {
      TRIDENT_ASSIGN_OR_RETURN(const bool failed, store.Contains(absl::StrCat(key, "error_", r)));
      if (!failed) continue;
      TRIDENT_ASSIGN_OR_RETURN(const std::string error, store.Get(absl::StrCat(key, "error_", r)));
      const absl::Status status = DecodeStatus(error);
      return r == 0 ? status : absl::Status(status.code(), absl::StrCat("rank ", r, ": ", status.message()));
    }
    std::map<std::string, Checksum> reported;
    for (const std::string& name : files) {
      TRIDENT_ASSIGN_OR_RETURN(const int64_t crc, store.Add(key + "crc/" + name, 0));
      TRIDENT_ASSIGN_OR_RETURN(const int64_t size, store.Add(key + "size/" + name, 0));
      if (crc == 0 || size == 0) return absl::DataLossError(absl::StrCat("no rank reported writing ", name));
      reported[name] = {static_cast<uint32_t>(crc - 1), size - 1};
    }
    return directory.Commit(step, world_size, val_loss, keep_last_n, reported);
  }

  // Waits until counter `name` reaches `count`.
  absl::Status AwaitCount(StoreClient& store, const std::atomic<bool>& cancelled, const std::string& name,
                          int64_t count) const {
    const absl::Time deadline = absl::Now() + timeout;
    while (true) {
      TRIDENT_ASSIGN_OR_RETURN(const int64_t value, store.Add(key + name, 0));
      if (value >= count) return absl::OkStatus();
      if (cancelled) return absl::CancelledError("the run ended before the checkpoint was committed");
      if (absl::Now() > deadline) {
        return absl::DeadlineExceededError(absl::StrCat(
            count - value, " rank(s) did not report writing their files within collective_timeout_s=",
            absl::FormatDuration(timeout), "; see their output, or raise collective_timeout_s for a slow disk"));
      }
      absl::SleepFor(absl::Milliseconds(5));
    }
  }
};

}  // namespace

absl::Status Trainer::Impl::SaveCheckpoint() {
  TRIDENT_RETURN_IF_ERROR(FinishPendingSave());  // one save at a time
  const int rank = topology().rank();
  const int world_size = topology().world_size();
  const bool async = config.checkpoint().async_save();
  const auto started = std::chrono::steady_clock::now();

  // The snapshot, on every rank at this step boundary. With async_save into
  // host buffers kept from the last save (no new memory to fault in; pinned
  // for GPU tensors).
  TRIDENT_ASSIGN_OR_RETURN(
      std::vector<SlicedTensor> pieces,
      model->CheckpointPieces(!config.checkpoint().no_save_optim(), config.checkpoint().save_type() != "sharded"));
  if (!config.checkpoint().no_save_rng()) {
    const at::Tensor rng = CpuRngState();
    pieces.push_back({RngName(rank), TensorSlice::Whole({rng.numel()}), rng});
  }
  if (async) {
    snapshot_buffers.resize(pieces.size());
    for (size_t i = 0; i < pieces.size(); ++i) {
      at::Tensor& buffer = snapshot_buffers[i];
      const at::Tensor& data = pieces[i].data;
      if (!buffer.defined() || buffer.sizes() != data.sizes() || buffer.scalar_type() != data.scalar_type()) {
        buffer = at::empty(data.sizes(), data.options().device(at::kCPU).pinned_memory(data.is_cuda()));
      }
      buffer.copy_(data);
      pieces[i].data = buffer;
    }
  }
  std::map<std::string, std::string> metadata = {{"step", absl::StrCat(step)},
                                                 {"layout", model->Layout()},
                                                 {"world_size", absl::StrCat(world_size)},
                                                 {"global_batch_size", absl::StrCat(global_batch_size())}};
  CheckpointJob job;
  if (config.checkpoint().save_type() != "merged") {
    for (int r = 0; r < world_size; ++r) job.files.push_back(absl::StrCat("rank_", r, ".safetensors"));
    metadata["rank"] = absl::StrCat(rank);
    job.writes.push_back([name = job.files[rank], pieces = std::move(pieces), metadata](
                             const std::string& staging, std::map<std::string, Checksum>* written) {
      return WriteSlicedSafetensors(absl::StrCat(staging, "/", name), pieces, metadata, &(*written)[name]);
    });
  } else {
    job.files = {"model.safetensors", "state.safetensors"};
    TRIDENT_ASSIGN_OR_RETURN(NamedTensors tensors, MergePieces(topology().world(), pieces));
    // Parameter names hold no '/'; optimizer, loss-scaler and RNG state do.
    NamedTensors weights, state;
    for (auto& item : tensors) (item.first.find('/') == std::string::npos ? weights : state).push_back(item);
    const size_t stored = weights.size();
    for (const auto& [alias, owner] : model->source().aliases) {  // tied names, as exports write them
      for (size_t i = 0; i < stored; ++i) {
        if (weights[i].first == owner) weights.emplace_back(alias, weights[i].second);
      }
    }
    if (is_rank0()) {
      job.writes.push_back([weights = std::move(weights), state = std::move(state), metadata](
                               const std::string& staging, std::map<std::string, Checksum>* written) {
        auto with_format = metadata;
        with_format["format"] = "pt";
        TRIDENT_RETURN_IF_ERROR(
            WriteSafetensors(staging + "/model.safetensors", weights, with_format, &(*written)["model.safetensors"]));
        return WriteSafetensors(staging + "/state.safetensors", state, metadata, &(*written)["state.safetensors"]);
      });
    }
  }
  if (is_rank0()) {
    job.files.push_back("config.pbtxt");
    job.writes.push_back([text = ConfigToText(config)](const std::string& staging,
                                                       std::map<std::string, Checksum>* written) -> absl::Status {
      std::ofstream out(staging + "/config.pbtxt");
      out << text;
      out.close();
      if (!out) return absl::InternalError(absl::StrCat("cannot write ", staging, "/config.pbtxt"));
      TRIDENT_ASSIGN_OR_RETURN((*written)["config.pbtxt"], FileChecksum(staging + "/config.pbtxt"));
      return absl::OkStatus();
    });
  }
  if (!save_store) {
    TRIDENT_ASSIGN_OR_RETURN(save_store, topology().ConnectStoreClient());
  }

  auto pending = std::make_unique<PendingSave>();
  pending->step = step;
  pending->path = absl::StrCat(config.checkpoint().save_dir(), "/step_", step);
  job.save_dir = config.checkpoint().save_dir();
  job.step = step;
  job.val_loss = last_val_loss;
  job.keep_last_n = config.checkpoint().keep_last_n();
  job.rank = rank;
  job.world_size = world_size;
  job.key = absl::StrCat("trident/checkpoint/", saves_started++, "/");
  job.timeout = absl::Seconds(config.runtime().collective_timeout_s());
  auto write_and_commit = [job = std::move(job), store = save_store.get(), save = pending.get(), async] {
    // A background writer yields the cores to training (nice 19 for this thread only).
    if (async) setpriority(PRIO_PROCESS, static_cast<id_t>(syscall(SYS_gettid)), 19);
    const auto write_started = std::chrono::steady_clock::now();
    absl::Status verdict = job.Run(*store, save->cancelled);
    save->write_s = SecondsSince(write_started);
    return verdict;
  };
  pending->verdict = std::async(async ? std::launch::async : std::launch::deferred, std::move(write_and_commit));
  pending->pause_s = SecondsSince(started);
  pending_save = std::move(pending);
  return async ? absl::OkStatus() : FinishPendingSave();
}

absl::Status Trainer::Impl::FinishPendingSave() {
  if (!pending_save) return absl::OkStatus();
  const std::unique_ptr<PendingSave> save = std::move(pending_save);
  const absl::Status verdict = save->verdict.get();
  if (verdict.ok()) {
    Print(absl::StrFormat(
        "saved checkpoint %s (%s; %s %.2f s, training paused %.2f s)", save->path, config.checkpoint().save_type(),
        config.checkpoint().async_save() ? "written in the background in" : "written in", save->write_s,
        config.checkpoint().async_save() ? save->pause_s : save->pause_s + save->write_s));
    ForHooks([&](TrainerHooks& h) { h.OnSaveCheckpoint(State(), save->path); });
    return absl::OkStatus();
  }
  const absl::Status failure(verdict.code(),
                             absl::StrCat("checkpoint step ", save->step, " was not saved: ", verdict.message(),
                                          "; `last` still points at the previous one"));
  if (config.checkpoint().save_failure() == "fail") return failure;
  Print(absl::StrCat("warning: ", failure.message(), " (save_failure=warn: training goes on)"));
  return absl::OkStatus();
}

absl::Status Trainer::Impl::LoadCheckpoint() {
  CheckpointDirectory directory(config.checkpoint().save_dir());
  const auto check_started = std::chrono::steady_clock::now();
  // The ranks split the checksumming of the candidate's files and agree on the verdict.
  const int rank = topology().rank(), world_size = topology().world_size();
  auto resolved = directory.Resolve(config.checkpoint().resume_from(), [&](const std::string& path) {
    auto manifest = CheckpointDirectory::Validate(path, rank, world_size);
    absl::Status agreed = AgreeOnFailure(topology().world(), manifest.status(), "checking the checkpoint");
    return agreed.ok() ? manifest : absl::StatusOr<CheckpointManifest>(agreed);
  });
  if (!resolved.ok()) {
    const bool nothing_saved_yet = config.checkpoint().resume_from() == "last" && absl::IsNotFound(resolved.status()) &&
                                   !fs::exists(config.checkpoint().save_dir() + "/last");
    if (!nothing_saved_yet) return resolved.status();
    Print(absl::StrCat("no checkpoint in ", config.checkpoint().save_dir(), " yet; starting from step 0"));
    return absl::OkStatus();
  }
  for (const std::string& reason : resolved->skipped) {
    Print(absl::StrCat("resume_from=last: skipping an invalid checkpoint: ", reason));
  }
  const double check_s = SecondsSince(check_started);
  const auto load_started = std::chrono::steady_clock::now();
  TRIDENT_ASSIGN_OR_RETURN(std::unique_ptr<CheckpointReader> reader, CheckpointReader::Open(resolved->path));
  const bool optimizer = !config.checkpoint().finetune() && !config.checkpoint().no_load_optim();
  TRIDENT_RETURN_IF_ERROR(model->LoadCheckpointPieces(*reader, optimizer));
  const std::string loaded = absl::StrFormat("; checksums checked in %.2f s, then rank 0 read %.1f MB in %.2f s",
                                             check_s, reader->bytes_read() / 1e6, SecondsSince(load_started));
  if (config.checkpoint().finetune()) {
    Print(absl::StrCat("finetune: loaded the weights of ", resolved->path, "; starting at step 0"));
    return absl::OkStatus();
  }
  step = resolved->manifest.step();
  if (resolved->manifest.has_val_loss()) last_val_loss = resolved->manifest.val_loss();
  // The saved layout, from any file's metadata.
  const std::map<std::string, std::string>& saved = reader->metadata().begin()->second;
  auto value = [&](const char* key) {
    auto found = saved.find(key);
    return found == saved.end() ? std::string() : found->second;
  };
  const bool same_layout =
      value("layout") == model->Layout() && value("world_size") == absl::StrCat(topology().world_size());
  std::string rng = "kept";
  if (config.checkpoint().no_load_rng()) {
    rng = "not loaded (no_load_rng)";
  } else if (same_layout && reader->Contains(RngName(topology().rank()))) {
    TRIDENT_ASSIGN_OR_RETURN(at::Tensor state, reader->ReadWhole(RngName(topology().rank())));
    SetCpuRngState(state);
  } else {
    SeedCpuRng(config.plan().seed(), step, topology().rank());
    rng = "re-derived from the seed and the step (the per-rank streams of another layout do not carry over)";
  }
  Print(absl::StrCat("resumed from ", resolved->path, " at step ", step,
                     same_layout ? ""
                                 : absl::StrCat(" (saved as ", value("layout"), " on ", value("world_size"),
                                                " ranks; resharded to ", model->Layout(), ")"),
                     "; RNG ", rng, loaded));
  if (value("global_batch_size") != absl::StrCat(global_batch_size())) {
    Print(absl::StrCat("note: the checkpoint was trained with global batch ", value("global_batch_size"),
                       " and this run uses ", global_batch_size(), "; the sample order from step ", step,
                       " follows the new batch size"));
  }
  ForHooks([&](TrainerHooks& h) { h.OnLoadCheckpoint(State(), resolved->path); });
  return absl::OkStatus();
}

absl::Status Trainer::Impl::ExportSafetensors(const std::string& path) {
  TRIDENT_ASSIGN_OR_RETURN(NamedTensors tensors, model->FullWeights());
  if (!is_rank0()) return absl::OkStatus();
  std::string what = "the model";
  if (model->plan().has_lora()) {
    const LoraConfig& lora = model->plan().lora();
    if (config.checkpoint().lora_merge_on_export()) {
      TRIDENT_ASSIGN_OR_RETURN(tensors, MergeAdapters(tensors, lora));
      what = absl::StrCat("the model with adapter '", lora.adapter_name(), "' merged in");
    } else {
      tensors = PeftAdapter(tensors, lora);
      what = absl::StrCat("adapter '", lora.adapter_name(), "' (PEFT names)");
    }
  }
  const auto parent = fs::path(path).parent_path();
  std::error_code error;
  if (!parent.empty()) fs::create_directories(parent, error);
  TRIDENT_RETURN_IF_ERROR(WriteSafetensors(path, tensors, {{"format", "pt"}}));
  Print(absl::StrCat("exported ", what, " to ", path));
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
  const std::string ops = operators == nullptr
                              ? ""
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
    const fs::path parent = fs::path(config.output().trace_file()).parent_path();
    if (!parent.empty()) fs::create_directories(parent, error);
    std::ofstream(config.output().trace_file()) << ChromeTraceJson(events, more);
    if (!events.empty()) {
      std::ofstream(fs::path(config.output().trace_file()).replace_extension(".svg")) << TimelineSvg(
          events, absl::StrCat(model->plan().pipeline().schedule(), ", step ", config.output().trace_step(), ", ",
                               topology().world_size(), " ranks (row = rank)"));
    }
    Print(absl::StrCat("wrote the ", operators ? "operators and " : "", "timeline of step ",
                       config.output().trace_step(), " to ", config.output().trace_file()));
  }
  return absl::OkStatus();
}

}  // namespace trident
