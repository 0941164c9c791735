#include "base/status.h"

#include <exception>
#include <iostream>
#include <stdexcept>
#include <string>

#include <c10/util/Exception.h>

#include "absl/strings/str_cat.h"

namespace trident {

absl::Status StatusFromCurrentException(absl::string_view context) {
  try {
    throw;
  } catch (const c10::Error& e) {
    return absl::InternalError(absl::StrCat(context, ": ", e.what_without_backtrace()));
  } catch (const std::invalid_argument& e) {
    return absl::InvalidArgumentError(absl::StrCat(context, ": ", e.what()));
  } catch (const std::exception& e) {
    return absl::InternalError(absl::StrCat(context, ": ", e.what()));
  } catch (...) {
    return absl::InternalError(absl::StrCat(context, ": unknown exception"));
  }
}

int ExitCodeFor(absl::string_view program, const absl::Status& status) {
  if (status.ok()) return 0;
  std::cerr << program << ": error: " << status.message() << std::endl;
  return 1;
}

}  // namespace trident
