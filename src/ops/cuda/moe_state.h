// Internal to the CUDA backend: MoeState, the device workspaces the router and moe_permute stems
// share — the route plan's per-block histograms (sized by prepare from max_tokens·top_k), the aux
// loss's per-chunk column sums (sized from E), and device counts/offsets for callers that ask for
// the route plan's counts/offsets in host memory — and the helpers both use.
#pragma once

#include <cuda_runtime.h>

#include <climits>

#include "runtime/cuda_check.h"
#include "runtime/memory.h"

namespace mop {

struct MoeState {
  Buffer plan;       // route plan: i32 [ceil(T·K/2048), E]
  Buffer aux;        // aux loss: f32 per-chunk column sums and lse² sums
  Buffer host_plan;  // i32 counts [E] and offsets [E+1] on the device, for host destinations
};


// Grows buf to at least `bytes`. After prepare_moe only calls beyond the prepared shapes get here
// (tests run without prepare). The stream is drained first, so no queued kernel still uses the old
// memory; the device is synchronised after, because Buffer zero-fills with a cudaMemset on the
// legacy stream, which our non-blocking stream does not wait for.
inline void reserve_moe(Buffer& buf, size_t bytes, cudaStream_t stream) {
  if (buf.bytes() >= bytes) return;
  MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  buf = Buffer();
  buf = Buffer(MemKind::Device, bytes);
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
}

inline void check_int(int64_t v, const char* what) {
  MOP_CHECK(v >= 0 && v <= INT_MAX, what, " = ", v, " does not fit the kernels' int sizes");
}

}  // namespace mop
