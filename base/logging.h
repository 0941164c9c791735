// Logging for all of Trident: LOG(INFO), CHECK(cond), DCHECK, VLOG.
//
// Debian's LibTorch is built with glog and these come from glog; PyTorch's own
// LibTorch builds (the GPU machines) define glog-compatible macros in c10. Include
// this header, never <glog/logging.h>, so one spelling works against both.
//
//   #include "base/logging.h"
//   CHECK_GT(world_size, 0) << "world size must be positive";
#ifndef TRIDENT_BASE_LOGGING_H_
#define TRIDENT_BASE_LOGGING_H_

#include <c10/util/Logging.h>

// Recent PyTorch builds define CHECK but no longer the comparison forms.
#ifndef CHECK_EQ
#define CHECK_EQ(a, b) CHECK((a) == (b))
#define CHECK_NE(a, b) CHECK((a) != (b))
#define CHECK_LT(a, b) CHECK((a) < (b))
#define CHECK_LE(a, b) CHECK((a) <= (b))
#define CHECK_GT(a, b) CHECK((a) > (b))
#define CHECK_GE(a, b) CHECK((a) >= (b))
#endif

#endif  // TRIDENT_BASE_LOGGING_H_
