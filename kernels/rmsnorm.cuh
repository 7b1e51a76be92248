// RMSNorm forward/backward over the last dim: bf16 data, fp32 math, fp32 statistics.
// rmsnorm_bwd's dw is deterministic: per-block partials in a caller-provided scratch, then a
// column sum in a fixed order. Launchers take the destination first and the stream last, check
// their preconditions and never allocate.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mop::kernels {

// y = x·rstd·w with rstd[r] = 1/sqrt(mean_c x[r,c]² + eps); x, y [rows, cols], w [cols], rstd
// [rows].
void rmsnorm_fwd(__nv_bfloat16* y, float* rstd, const __nv_bfloat16* x, const __nv_bfloat16* w,
                 int64_t rows, int64_t cols, float eps, cudaStream_t stream);

// Floats of scratch rmsnorm_bwd needs for a [rows, cols] input (its per-block dw partials).
int64_t rmsnorm_bwd_scratch_floats(int64_t rows, int64_t cols);

// dx (+)= ∂/∂x, dw[c] += Σ_r dy[r,c]·x[r,c]·rstd[r]. dx may alias dy. `scratch` holds at least
// rmsnorm_bwd_scratch_floats(rows, cols) floats and is free once the stream has passed this call.
void rmsnorm_bwd(__nv_bfloat16* dx, float* dw, const __nv_bfloat16* dy, const __nv_bfloat16* x,
                 const __nv_bfloat16* w, const float* rstd, int64_t rows, int64_t cols,
                 bool accumulate_dx, float* scratch, int64_t scratch_floats, cudaStream_t stream);

}  // namespace mop::kernels
