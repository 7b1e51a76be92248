// Rotary position embedding (rotate-half layout, in place) on bf16 data with fp32 math. The
// launcher takes the destination first and the stream last, checks its preconditions and never
// allocates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mop::kernels {

// Largest dim/2 that rope supports (a block keeps cos/sin of its tokens in shared memory).
constexpr int64_t kRopeMaxHalfDim = 4096;

// Rotates the pairs (i, i + dim/2) of x [tokens, heads, dim] in place by
// angle = float(pos[t]) · inv_freq[i] (one fp32 product), or by −angle when `inverse`; cos and sin
// are evaluated in fp64 and rounded to fp32, the rotation is fp32 without fused multiply-adds.
// inv_freq [dim/2] lives on the device.
void rope(__nv_bfloat16* x, const int32_t* pos, const float* inv_freq, int64_t tokens,
          int64_t heads, int64_t dim, bool inverse, cudaStream_t stream);

}  // namespace mop::kernels
