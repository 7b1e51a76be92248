// attention_merge (see attention_merge.cuh): one warp per (token, head) row of D elements, a
// grid-stride loop over the rows. Every lane computes the row's two weights from the two lse
// values (the same two loads for the whole warp), then the lanes stride over D. Memory-bound:
// 4 B read + 4 B written per accumulator element and 2 B read of o.
#include <cmath>

#include "runtime/cuda_check.h"
#include "kernels/attention_merge.cuh"

namespace mop::kernels {
namespace {

constexpr int kThreads = 256;
constexpr int kWarpSize = 32;
constexpr int kWarps = kThreads / kWarpSize;

__global__ void __launch_bounds__(kThreads)
    attention_merge_kernel(float* __restrict__ out_acc, float* __restrict__ lse_acc,
                           const __nv_bfloat16* __restrict__ o, const float* __restrict__ lse,
                           int64_t seq, int64_t heads, int64_t dim, int64_t num_rows) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t num_warps = int64_t(gridDim.x) * kWarps;
  for (int64_t row = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; row < num_rows;
       row += num_warps) {
    // row = t·heads + h, t = b·seq + s; the lse element of (b, h, s).
    const int64_t t = row / heads, h = row % heads, b = t / seq, s = t % seq;
    const int64_t li = (b * heads + h) * seq + s;
    const float la = lse_acc[li], lb = lse[li];
    const float m = fmaxf(la, lb);
    if (m == -INFINITY) continue;  // neither side has seen a key
    // logaddexp without overflow: m + log(1 + exp(−|la − lb|)).
    const float l = m + log1pf(expf(fminf(la, lb) - m));
    const float wa = expf(la - l), wb = expf(lb - l);
    float* acc = out_acc + row * dim;
    const __nv_bfloat16* part = o + row * dim;
    for (int64_t d = lane; d < dim; d += kWarpSize) {
      // wa = 0 (empty accumulator): out_acc is not read, so unset memory cannot leak NaN in.
      const float prev = wa == 0.f ? 0.f : wa * acc[d];
      acc[d] = prev + wb * __bfloat162float(part[d]);
    }
    __syncwarp();
    if (lane == 0) lse_acc[li] = l;
  }
}

}  // namespace

void attention_merge(float* out_acc, float* lse_acc, const __nv_bfloat16* o, const float* lse,
                     int64_t batch, int64_t seq, int64_t heads, int64_t dim, cudaStream_t stream) {
  MOP_CHECK(batch >= 0 && seq >= 0 && heads >= 0 && dim >= 0, "attention_merge: negative size");
  const int64_t num_rows = batch * seq * heads;
  if (num_rows == 0) return;
  MOP_CHECK(out_acc && lse_acc && o && lse, "attention_merge: null pointer");
  int64_t blocks = (num_rows + kWarps - 1) / kWarps;
  if (blocks > 8192) blocks = 8192;
  attention_merge_kernel<<<unsigned(blocks), kThreads, 0, stream>>>(out_acc, lse_acc, o, lse, seq,
                                                                     heads, dim, num_rows);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
