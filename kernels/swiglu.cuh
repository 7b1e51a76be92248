// SwiGLU forward/backward on bf16 data with fp32 math. Launchers take the destination first and the
// stream last, check their preconditions and the launch, and never allocate.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mop::kernels {

// h[r, c] = silu(g[r, c]) · u[r, c] with gu = [g | u]: h is [rows, width], gu [rows, 2·width].
void swiglu_fwd(__nv_bfloat16* h, const __nv_bfloat16* gu, int64_t rows, int64_t width,
                cudaStream_t stream);
// dgu = [dg | du] from dh [rows, width] and gu [rows, 2·width]; dgu may alias gu.
void swiglu_bwd(__nv_bfloat16* dgu, const __nv_bfloat16* dh, const __nv_bfloat16* gu, int64_t rows,
                int64_t width, cudaStream_t stream);

}  // namespace mop::kernels
