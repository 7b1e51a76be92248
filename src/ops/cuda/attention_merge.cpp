// CUDA backend, attention_merge stem: merging a partial attention result into an fp32
// accumulator by log-sum-exp (ring attention; kernels/attention_merge.cu).
#include <cuda_bf16.h>

#include "kernels/attention_merge.cuh"
#include "ops/cuda/backend.h"

namespace mop {

void CudaBackend::attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                              int batch) {
  const int64_t rows = o.shape[0], heads = o.shape[1], dim = o.shape[2], seq = rows / batch;
  kernels::attention_merge(out_acc.ptr<float>(), lse_acc.ptr<float>(),
                           static_cast<const __nv_bfloat16*>(o.data), lse.ptr<float>(), batch, seq,
                           heads, dim, stream_);
}

}  // namespace mop
