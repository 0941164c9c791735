// Where a step's metrics go: JSON lines, TensorBoard, and the console (a
// progress bar on a terminal, log lines otherwise).
#include <cstdio>

#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "trainer/internal/trainer_impl.h"

namespace trident {
namespace {

std::string HumanRate(double value) {
  if (value >= 1e6) return absl::StrFormat("%.2fM", value / 1e6);
  if (value >= 1e3) return absl::StrFormat("%.1fk", value / 1e3);
  return absl::StrFormat("%.0f", value);
}

}  // namespace

void Trainer::Impl::Report(const StepMetrics& m, int64_t max_steps) {
  std::vector<std::pair<std::string, double>> values = {{"loss", m.loss},
                                                        {"lr", m.lr},
                                                        {"grad_norm", m.grad_norm},
                                                        {"tokens_per_s", m.tokens_per_s},
                                                        {"step_time_ms", m.step_time_ms},
                                                        {"elapsed_s", m.elapsed_s},
                                                        {"mfu", m.mfu}};
  if (model->loss_scale()) {
    values.emplace_back("loss_scale", m.loss_scale);
    values.emplace_back("skipped", m.skipped ? 1 : 0);
  }
  for (const auto& [part, ms] : m.wall_clock_ms) values.emplace_back(absl::StrCat("time_", part, "_ms"), ms);
  if (metrics) metrics->Write(m.step, values);
  if (tensorboard) tensorboard->Write(m.step, values);
  if (!m.wall_clock_ms.empty() && (m.step % config.output().log_every() == 0 || m.step == max_steps)) {
    std::string parts;  // every rank prints its own
    for (const auto& [part, ms] : m.wall_clock_ms) absl::StrAppendFormat(&parts, " | %s %.1f", part, ms);
    std::printf("step %lld wall clock (ms)%s\n", static_cast<long long>(m.step), parts.c_str());
    std::fflush(stdout);
  }
  if (!is_rank0()) return;
  const char* unit = train_data->tokens_per_sample() > 0 ? "tok/s" : "samples/s";
  const double eta = m.step_time_ms / 1000.0 * (max_steps - m.step);
  if (progress_bar) {
    const int width = 24, filled = static_cast<int>(width * m.step / max_steps);
    std::printf("\rstep %lld/%lld [%s%s] loss %.4f | %s %s | ETA %s   ", static_cast<long long>(m.step),
                static_cast<long long>(max_steps), std::string(filled, '=').c_str(),
                std::string(width - filled, ' ').c_str(), m.loss, HumanRate(m.tokens_per_s).c_str(), unit,
                internal::FormatDuration(eta).c_str());
    if (m.step == max_steps) std::printf("\n");
    std::fflush(stdout);
  } else if (m.step % config.output().log_every() == 0 || m.step == max_steps) {
    Print(absl::StrFormat("step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s %s | %.0f ms/step | mfu %s | ETA %s",
                          m.step, max_steps, m.loss, m.lr, m.grad_norm, HumanRate(m.tokens_per_s), unit, m.step_time_ms,
                          peak_flops > 0 ? absl::StrFormat("%.1f%%", 100 * m.mfu) : "n/a",
                          internal::FormatDuration(eta)));
  }
}

std::vector<std::pair<std::string, double>> WallClockBreakdown(double data_s,
                                                               const std::vector<TimelineEvent>& timeline,
                                                               const std::map<std::string, CommunicationTime>& before,
                                                               const std::map<std::string, CommunicationTime>& after,
                                                               double optimizer_s, double step_s) {
  double forward = 0, backward = 0, p2p = 0;
  for (const TimelineEvent& e : timeline) {
    const double s = e.end - e.start;
    switch (e.op) {
      case Op::kForward:
        forward += s;
        break;
      case Op::kBackward:
      case Op::kBackwardInput:
      case Op::kBackwardWeight:
      case Op::kRecompute:
        backward += s;
        break;
      case Op::kSendActivation:
      case Op::kRecvActivation:
      case Op::kSendGrad:
      case Op::kRecvGrad:
      case Op::kSendActivationRecvGrad:
      case Op::kSendGradRecvActivation:
      case Op::kPostSendActivationRecvGrad:
      case Op::kWaitPosted:
        p2p += s;
        break;
      default:  // data loading, reductions (counted by collective kind), the optimizer
        break;
    }
  }
  std::vector<std::pair<std::string, double>> parts = {
      {"data", 1e3 * data_s}, {"forward", 1e3 * forward}, {"backward", 1e3 * backward}};  // recomputation too
  if (p2p > 0) parts.emplace_back("pipeline_p2p", 1e3 * p2p);
  for (const auto& [kind, time] : after) {
    if (kind == "send" || kind == "recv") continue;  // in pipeline_p2p
    auto earlier = before.find(kind);
    const double seconds = time.seconds - (earlier == before.end() ? 0.0 : earlier->second.seconds);
    if (seconds > 0) parts.emplace_back(kind, 1e3 * seconds);
  }
  parts.emplace_back("optimizer", 1e3 * optimizer_s);
  parts.emplace_back("step", 1e3 * step_s);
  return parts;
}

}  // namespace trident
