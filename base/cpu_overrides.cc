#include "base/internal/cpu_overrides.h"

#include <string>

#include <c10/util/Exception.h>
#include <torch/version.h>

namespace trident {
namespace internal {

void OverrideAtenCpuKernels(const std::function<void(torch::Library&)>& define) {
#if TORCH_VERSION_MAJOR >= 2
  struct Quiet : c10::WarningHandler {
    void process(const c10::Warning&) override {}
  } quiet;
  c10::WarningUtils::WarningHandlerGuard guard(&quiet);
#else
  struct Quiet : c10::WarningHandler {
    void process(const c10::SourceLocation&, const std::string&, const bool) override {}
  } quiet;
  c10::Warning::WarningHandlerGuard guard(&quiet);
#endif
  auto* library = new torch::Library(torch::Library::IMPL, "aten", c10::DispatchKey::CPU, __FILE__, __LINE__);
  define(*library);
}

}  // namespace internal
}  // namespace trident
