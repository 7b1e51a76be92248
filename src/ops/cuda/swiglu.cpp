// CUDA backend, swiglu stem: SwiGLU forward and backward (kernels/swiglu.cu).
#include "kernels/swiglu.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/pointwise.h"

namespace mop {

// ---- SwiGLU -----------------------------------------------------------------------------------

void CudaBackend::swiglu_fwd(Tensor h, const Tensor& gu) {
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  kernels::swiglu_fwd(bf16_ptr(h), bf16_ptr(gu), rows, width, stream_);
}

void CudaBackend::swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) {
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  kernels::swiglu_bwd(bf16_ptr(dgu), bf16_ptr(dh), bf16_ptr(gu), rows, width, stream_);
}

}  // namespace mop
