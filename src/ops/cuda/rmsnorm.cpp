// CUDA backend, rmsnorm stem: RMSNorm forward and backward (kernels/rmsnorm.cu); the backward's dw
// partials live in the pointwise state.
#include "kernels/rmsnorm.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/pointwise.h"

namespace mop {

// ---- RMSNorm ----------------------------------------------------------------------------------

void CudaBackend::rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  kernels::rmsnorm_fwd(bf16_ptr(y), rstd.ptr<float>(), bf16_ptr(x), bf16_ptr(w), rows, cols, eps,
                       stream_);
}

void CudaBackend::rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                          const Tensor& rstd, bool accumulate_dx) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  if (rows == 0 || cols == 0) return;
  PointwiseState& s = pointwise_state();
  const int64_t floats = kernels::rmsnorm_bwd_scratch_floats(rows, cols);
  reserve(s.dw_partials, MemKind::Device, size_t(floats) * sizeof(float), stream_);
  kernels::rmsnorm_bwd(bf16_ptr(dx), dw.ptr<float>(), bf16_ptr(dy), bf16_ptr(x), bf16_ptr(w),
                       rstd.ptr<float>(), rows, cols, accumulate_dx,
                       static_cast<float*>(s.dw_partials.data()),
                       int64_t(s.dw_partials.bytes() / sizeof(float)), stream_);
}

}  // namespace mop
