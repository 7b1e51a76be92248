// Cross-entropy over rows of fp32 logits (one token chunk of the fused LM head): per-row
// log-sum-exp and loss, and the gradient of the loss w.r.t. the logits in bf16 (the A operand of
// the two backward GEMMs). One block per row, fixed reduction order: bitwise reproducible.
// Plain declarations only, so host C++ files include this header.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mop::kernels {

// For r < rows, with z = logits[r] (fp32 [rows, vocab], contiguous):
//   lse[r]  = log Σ_v exp(z[v])
//   loss[r] = lse[r] − z[targets[r]]; 0 where targets[r] < 0 (masked), NaN where ≥ vocab (a bad
//             target cannot be reported from the device without a synchronisation).
// loss, lse fp32 [rows]; targets i32 [rows] (device). vocab ≥ 1.
void cross_entropy_fwd(float* loss, float* lse, const float* logits, const int32_t* targets,
                       int64_t rows, int64_t vocab, cudaStream_t stream);

// dlogits[r,v] = (exp(z[v] − lse[r]) − [v == targets[r]]) · grad_scale, rounded to bf16 (nearest
// even); rows with targets[r] < 0 are all zero. dlogits bf16 [rows, vocab]; logits fp32
// [rows, vocab]; lse fp32 [rows] (from cross_entropy_fwd); targets i32 [rows].
void cross_entropy_bwd(__nv_bfloat16* dlogits, const float* logits, const float* lse,
                       const int32_t* targets, float grad_scale, int64_t rows, int64_t vocab,
                       cudaStream_t stream);

}  // namespace mop::kernels
