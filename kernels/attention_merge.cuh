// Merge of a partial attention result into an fp32 accumulator (ring attention; ops.h
// attention_merge): per (token, head), with lse' = logaddexp(lse_acc, lse),
//   out_acc = out_acc·exp(lse_acc − lse') + o·exp(lse − lse'),  lse_acc = lse'.
// lse_acc = −inf is an empty accumulator (its out_acc is not read). Launchers take the destination
// first and the stream last, check their preconditions and the launch, and never allocate.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace mop::kernels {

// out_acc fp32 [batch·seq, heads, dim] and lse_acc fp32 [batch, heads, seq] (updated in place);
// o bf16 [batch·seq, heads, dim]; lse fp32 [batch, heads, seq].
void attention_merge(float* out_acc, float* lse_acc, const __nv_bfloat16* o, const float* lse,
                     int64_t batch, int64_t seq, int64_t heads, int64_t dim, cudaStream_t stream);

}  // namespace mop::kernels
