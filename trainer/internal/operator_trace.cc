#include "trainer/internal/operator_trace.h"

#include <algorithm>
#include <map>
#include <set>
#include <utility>

#include <ATen/ATen.h>
#include <torch/csrc/autograd/profiler_kineto.h>
#include <torch/version.h>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "base/status.h"

namespace trident {
namespace internal {
namespace {

namespace profiler = torch::autograd::profiler;
using torch::profiler::impl::ActivityType;
using torch::profiler::impl::ProfilerConfig;
using torch::profiler::impl::ProfilerState;

// Start and duration in microseconds (LibTorch 2 counts nanoseconds).
double StartUs(const profiler::KinetoEvent& e) {
#if TORCH_VERSION_MAJOR >= 2
  return static_cast<double>(e.startNs()) / 1e3;
#else
  return static_cast<double>(e.startUs());
#endif
}
double DurationUs(const profiler::KinetoEvent& e) {
#if TORCH_VERSION_MAJOR >= 2
  return static_cast<double>(e.durationNs()) / 1e3;
#else
  return static_cast<double>(e.durationUs());
#endif
}

std::string JsonEscaped(const std::string& text) {
  std::string escaped;
  for (char c : text) {
    if (c == '"' || c == '\\') escaped += '\\';
    if (static_cast<unsigned char>(c) >= 0x20) escaped += c;
  }
  return escaped;
}

bool recording_gpu = false;  // whether the running recording includes GPU kernels

// A kernel's name without the words every kernel of LibTorch repeats, so a
// table column shows the functor ("vectorized_elementwise_kernel<4,
// CUDAFunctor_add<float>...").
std::string ShortName(std::string name) {
  for (const char* word : {"void ", "at::native::", "(anonymous namespace)::"}) {
    for (size_t at = name.find(word); at != std::string::npos; at = name.find(word, at)) {
      name.erase(at, std::string(word).size());
    }
  }
  return name;
}

}  // namespace

absl::Status StartOperatorRecording(bool gpu_kernels) {
  if (torch::profiler::impl::profilerEnabled()) {
    return absl::FailedPreconditionError("a LibTorch profiler is already recording in this process");
  }
  recording_gpu = gpu_kernels;
  return CatchExceptions("starting LibTorch's profiler", [gpu_kernels] {
    std::set<ActivityType> activities{ActivityType::CPU};
    if (gpu_kernels) activities.insert(ActivityType::CUDA);
    const ProfilerConfig config(ProfilerState::KINETO);
    profiler::prepareProfiler(config, activities);  // Kineto's GPU tracing must be prepared first
    profiler::enableProfiler(config, activities);
  });
}

absl::StatusOr<std::vector<OperatorEvent>> StopOperatorRecording(const std::string& anchor) {
  std::unique_ptr<profiler::ProfilerResult> result;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("stopping LibTorch's profiler", [&] {
    // A copy to the CPU waits for the kernels queued before it.
    if (recording_gpu) at::zeros({1}, at::Device(at::kCUDA)).cpu();
    result = profiler::disableProfiler();
  }));
  double zero = -1;
  uint64_t main_thread = 0;  // the anchor's thread, row 0
  for (const profiler::KinetoEvent& e : result->events()) {
    if (e.name() == anchor && (zero < 0 || StartUs(e) < zero)) {
      zero = StartUs(e);
      main_thread = e.startThreadId();
    }
  }
  if (zero < 0) return absl::InternalError(absl::StrCat("the profiled step never ran '", anchor, "'"));
  // (on the GPU, thread or stream) -> row
  std::map<std::pair<bool, int64_t>, int> threads{{{false, static_cast<int64_t>(main_thread)}, 0}};
  // Scopes appear on the GPU's timeline too, as annotations spanning their
  // kernels: only the CPU's copy is kept.
  std::set<std::string> cpu_names;
  for (const profiler::KinetoEvent& e : result->events()) {
    if (e.deviceType() == c10::DeviceType::CPU) cpu_names.insert(e.name());
  }
  std::vector<OperatorEvent> events;
  for (const profiler::KinetoEvent& e : result->events()) {
    const bool on_gpu = e.deviceType() != c10::DeviceType::CPU;
    if (on_gpu && cpu_names.count(e.name())) continue;
    const int64_t key = on_gpu ? e.deviceResourceId() : static_cast<int64_t>(e.startThreadId());
    const auto [thread, added] = threads.emplace(std::make_pair(on_gpu, key), static_cast<int>(threads.size()));
    events.push_back(
        {e.name(), (StartUs(e) - zero) / 1e6, (StartUs(e) + DurationUs(e) - zero) / 1e6, thread->second, on_gpu});
  }
  return events;
}

std::string OperatorTraceEvents(const std::vector<OperatorEvent>& events, int pid, int first_tid,
                                const std::string& label) {
  std::string json;
  std::map<int, bool> threads;  // row -> on the GPU
  for (const OperatorEvent& e : events) {
    threads[e.thread] = e.on_gpu;
    absl::StrAppend(
        &json, json.empty() ? "" : ",\n",
        absl::StrFormat("{\"name\":\"%s\",\"cat\":\"operator\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                        "\"ts\":%.3f,\"dur\":%.3f}",
                        JsonEscaped(e.name), pid, first_tid + e.thread, e.start * 1e6, (e.end - e.start) * 1e6));
  }
  for (const auto& [thread, on_gpu] : threads) {
    absl::StrAppend(
        &json, json.empty() ? "" : ",\n",
        absl::StrFormat("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                        "\"args\":{\"name\":\"%s %s %d\"}}",
                        pid, first_tid + thread, JsonEscaped(label), on_gpu ? "gpu stream" : "thread", thread));
  }
  return json;
}

std::string OperatorBreakdown(const std::vector<OperatorEvent>& events, int rows) {
  // Per thread, in start order: an event's callees are the events inside it.
  std::vector<const OperatorEvent*> sorted;
  for (const OperatorEvent& e : events) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const OperatorEvent* a, const OperatorEvent* b) {
    return a->thread != b->thread ? a->thread < b->thread
           : a->start != b->start ? a->start < b->start
                                  : a->end > b->end;
  });
  struct Total {
    double self = 0;
    int64_t calls = 0;
  };
  const bool gpu = std::any_of(events.begin(), events.end(), [](const OperatorEvent& e) { return e.on_gpu; });
  std::map<std::string, Total> totals;
  std::vector<const OperatorEvent*> open;  // the enclosing events of the current one
  std::vector<std::pair<double, double>> kernels;
  double first = 0, last = 0;
  for (const OperatorEvent* e : sorted) {
    while (!open.empty() && (open.back()->thread != e->thread || open.back()->end <= e->start)) open.pop_back();
    if (open.empty() && e->thread == 0) {
      first = std::min(first, e->start);
      last = std::max(last, e->end);
    }
    if (gpu && !e->on_gpu) continue;  // kernels do not nest: their self time is their time
    if (e->on_gpu) kernels.emplace_back(e->start, e->end);
    Total& total = totals[e->name];
    total.self += e->end - e->start;
    ++total.calls;
    if (!open.empty()) totals[open.back()->name].self -= e->end - e->start;
    open.push_back(e);
  }
  std::vector<std::pair<std::string, Total>> by_time(totals.begin(), totals.end());
  std::sort(by_time.begin(), by_time.end(), [](const auto& a, const auto& b) { return a.second.self > b.second.self; });
  const double step = std::max(1e-9, last - first);
  std::string table =
      absl::StrFormat("%-56s %10s %8s %7s\n", gpu ? "GPU kernel" : "operator (self time)", "ms", "calls", "share");
  for (int i = 0; i < std::min<int>(rows, static_cast<int>(by_time.size())); ++i) {
    const auto& [name, total] = by_time[i];
    absl::StrAppend(&table, absl::StrFormat("%-56s %10.2f %8d %6.1f%%\n", ShortName(name).substr(0, 56),
                                            1e3 * total.self, total.calls, 100 * total.self / step));
  }
  absl::StrAppend(&table, absl::StrFormat("step (main thread, first to last operator): %.2f ms\n", 1e3 * step));
  if (gpu) {  // the union of the kernels' intervals on all streams
    std::sort(kernels.begin(), kernels.end());
    double busy = 0, covered = -1e300;
    for (const auto& [start, end] : kernels) {
      busy += std::max(0.0, end - std::max(start, covered));
      covered = std::max(covered, end);
    }
    absl::StrAppend(&table, absl::StrFormat("GPU busy (any kernel running): %.2f ms, %.1f%% of the step\n", 1e3 * busy,
                                            100 * busy / step));
  }
  return table;
}

}  // namespace internal
}  // namespace trident
