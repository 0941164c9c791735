// absl::Status helpers: early-return macros, exception conversion, and the one
// place a binary turns a failed status into an error line and an exit code.
//
//   absl::StatusOr<int> ParsePort(absl::string_view s);
//   absl::Status Connect() {
//     TRIDENT_ASSIGN_OR_RETURN(int port, ParsePort("29500"));
//     TRIDENT_RETURN_IF_ERROR(Dial(port));
//     return absl::OkStatus();
//   }
#ifndef TRIDENT_BASE_STATUS_H_
#define TRIDENT_BASE_STATUS_H_

#include <utility>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"

namespace trident {

// Converts the exception being handled (call only inside a `catch` block) into a
// status whose message starts with `context` (what was being done). c10::Error
// messages lose their C++ backtrace; unknown exceptions become kInternal.
absl::Status StatusFromCurrentException(absl::string_view context);

// Runs `fn` and converts any exception it throws with StatusFromCurrentException.
template <typename Fn>
absl::Status CatchExceptions(absl::string_view context, Fn&& fn) {
  try {
    std::forward<Fn>(fn)();
  } catch (...) {
    return StatusFromCurrentException(context);
  }
  return absl::OkStatus();
}

// Prints "<program>: error: <message>" on stderr and returns 1; returns 0 for OK.
// Binaries end `main` with `return ExitCodeFor(argv[0], RunMain(...));`.
int ExitCodeFor(absl::string_view program, const absl::Status& status);

}  // namespace trident

#define TRIDENT_STATUS_CONCAT_INNER_(a, b) a##b
#define TRIDENT_STATUS_CONCAT_(a, b) TRIDENT_STATUS_CONCAT_INNER_(a, b)

// Returns from the enclosing function if `expr` (an absl::Status) is not OK.
#define TRIDENT_RETURN_IF_ERROR(expr)                  \
  do {                                                 \
    ::absl::Status trident_status_ = (expr);           \
    if (!trident_status_.ok()) return trident_status_; \
  } while (false)

// `lhs` = value of `expr` (an absl::StatusOr<T>), or returns its error.
#define TRIDENT_ASSIGN_OR_RETURN(lhs, expr) \
  TRIDENT_ASSIGN_OR_RETURN_IMPL_(TRIDENT_STATUS_CONCAT_(trident_statusor_, __LINE__), lhs, expr)

#define TRIDENT_ASSIGN_OR_RETURN_IMPL_(statusor, lhs, expr) \
  auto statusor = (expr);                                   \
  if (!statusor.ok()) return std::move(statusor).status();  \
  lhs = std::move(statusor).value()

#endif  // TRIDENT_BASE_STATUS_H_
