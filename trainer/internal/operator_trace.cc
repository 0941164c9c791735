#include "trainer/internal/operator_trace.h"

#include <algorithm>
#include <map>
#include <set>

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

}  // namespace

absl::Status StartOperatorRecording() {
  if (torch::profiler::impl::profilerEnabled()) {
    return absl::FailedPreconditionError("a LibTorch profiler is already recording in this process");
  }
  return CatchExceptions("starting LibTorch's profiler", [] {
    profiler::enableProfiler(ProfilerConfig(ProfilerState::KINETO), {ActivityType::CPU});
  });
}

absl::StatusOr<std::vector<OperatorEvent>> StopOperatorRecording(const std::string& anchor) {
  std::unique_ptr<profiler::ProfilerResult> result;
  TRIDENT_RETURN_IF_ERROR(CatchExceptions("stopping LibTorch's profiler", [&] { result = profiler::disableProfiler(); }));
  double zero = -1;
  for (const profiler::KinetoEvent& e : result->events()) {
    if (e.name() == anchor && (zero < 0 || StartUs(e) < zero)) zero = StartUs(e);
  }
  if (zero < 0) return absl::InternalError(absl::StrCat("the profiled step never ran '", anchor, "'"));
  std::map<uint64_t, int> threads;
  std::vector<OperatorEvent> events;
  for (const profiler::KinetoEvent& e : result->events()) {
    const auto [thread, added] = threads.emplace(e.startThreadId(), static_cast<int>(threads.size()));
    events.push_back({e.name(), (StartUs(e) - zero) / 1e6, (StartUs(e) + DurationUs(e) - zero) / 1e6, thread->second});
  }
  return events;
}

std::string OperatorTraceEvents(const std::vector<OperatorEvent>& events, int pid, int first_tid,
                                const std::string& label) {
  std::string json;
  std::set<int> threads;
  for (const OperatorEvent& e : events) {
    threads.insert(e.thread);
    absl::StrAppend(&json, json.empty() ? "" : ",\n",
                    absl::StrFormat("{\"name\":\"%s\",\"cat\":\"operator\",\"ph\":\"X\",\"pid\":%d,\"tid\":%d,"
                                    "\"ts\":%.3f,\"dur\":%.3f}",
                                    JsonEscaped(e.name), pid, first_tid + e.thread, e.start * 1e6,
                                    (e.end - e.start) * 1e6));
  }
  for (int thread : threads) {
    absl::StrAppend(&json, json.empty() ? "" : ",\n",
                    absl::StrFormat("{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":%d,"
                                    "\"args\":{\"name\":\"%s thread %d\"}}",
                                    pid, first_tid + thread, JsonEscaped(label), thread));
  }
  return json;
}

std::string OperatorBreakdown(const std::vector<OperatorEvent>& events, int rows) {
  // Per thread, in start order: an event's callees are the events inside it.
  std::vector<const OperatorEvent*> sorted;
  for (const OperatorEvent& e : events) sorted.push_back(&e);
  std::sort(sorted.begin(), sorted.end(), [](const OperatorEvent* a, const OperatorEvent* b) {
    return a->thread != b->thread ? a->thread < b->thread
                                  : a->start != b->start ? a->start < b->start : a->end > b->end;
  });
  struct Total {
    double self = 0;
    int64_t calls = 0;
  };
  std::map<std::string, Total> totals;
  std::vector<const OperatorEvent*> open;  // the enclosing events of the current one
  double first = 0, last = 0;
  for (const OperatorEvent* e : sorted) {
    while (!open.empty() && (open.back()->thread != e->thread || open.back()->end <= e->start)) open.pop_back();
    Total& total = totals[e->name];
    total.self += e->end - e->start;
    ++total.calls;
    if (!open.empty()) totals[open.back()->name].self -= e->end - e->start;
    if (open.empty() && e->thread == 0) {
      first = std::min(first, e->start);
      last = std::max(last, e->end);
    }
    open.push_back(e);
  }
  std::vector<std::pair<std::string, Total>> by_time(totals.begin(), totals.end());
  std::sort(by_time.begin(), by_time.end(), [](const auto& a, const auto& b) { return a.second.self > b.second.self; });
  const double step = std::max(1e-9, last - first);
  std::string table = absl::StrFormat("%-56s %10s %8s %7s\n", "operator (self time)", "ms", "calls", "share");
  for (int i = 0; i < std::min<int>(rows, static_cast<int>(by_time.size())); ++i) {
    const auto& [name, total] = by_time[i];
    absl::StrAppend(&table, absl::StrFormat("%-56s %10.2f %8d %6.1f%%\n", name.substr(0, 56), 1e3 * total.self,
                                            total.calls, 100 * total.self / step));
  }
  absl::StrAppend(&table, absl::StrFormat("step (main thread, first to last operator): %.2f ms\n", 1e3 * step));
  return table;
}

}  // namespace internal
}  // namespace trident
