// MOP_NCCL_CHECK: a failing NCCL call throws mop::Error naming the statement, NCCL's error string
// and its last-error detail (often the actual cause: a peer that vanished, a CUDA error, a
// transport that failed), file:line, rank and host. CUDA builds only (needs nccl.h).
#pragma once

#include <nccl.h>

#include <string>

#include "core/error.h"

namespace mop::detail {

inline std::string nccl_error_message(ncclResult_t result) {
  std::string msg = ncclGetErrorString(result);
  // The last error is per thread and not cleared by reading; it may describe an earlier
  // asynchronous failure, which is still the most useful thing to show next to this one.
  const char* last = ncclGetLastError(nullptr);
  if (last && *last) msg.append("; last NCCL error: ").append(last);
  return msg;
}

}  // namespace mop::detail

#define MOP_NCCL_CHECK(call)                                                \
  do {                                                                      \
    ncclResult_t mop_nccl_rc_ = (call);                                     \
    if (mop_nccl_rc_ != ncclSuccess) [[unlikely]]                           \
      ::mop::detail::fail("NCCL error", #call, __FILE__, __LINE__,          \
                          ::mop::detail::nccl_error_message(mop_nccl_rc_)); \
  } while (0)
