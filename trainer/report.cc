// Where a step's metrics go: JSON lines, TensorBoard, and the console (a
// progress bar on a terminal, log lines otherwise).
#include <cstdio>

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
  if (metrics) metrics->Write(m.step, values);
  if (tensorboard) tensorboard->Write(m.step, values);
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
  } else if (m.step % config.log_every() == 0 || m.step == max_steps) {
    Print(absl::StrFormat(
        "step %d/%d | loss %.4f | lr %.2e | grad_norm %.3f | %s %s | %.0f ms/step | mfu %s | ETA %s", m.step,
        max_steps, m.loss, m.lr, m.grad_norm, HumanRate(m.tokens_per_s), unit, m.step_time_ms,
        peak_flops > 0 ? absl::StrFormat("%.1f%%", 100 * m.mfu) : "n/a", internal::FormatDuration(eta)));
  }
}

}  // namespace trident
