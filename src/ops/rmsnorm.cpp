// Front of RMSNorm (forward, backward): the checks, then the backend's hooks (cpu/rmsnorm.cpp,
// cuda/rmsnorm.cpp, kernels/rmsnorm.cu).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {

void Ops::rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) {
  MOP_CHECK(x.ndim == 2, "rmsnorm_fwd: x must be [N,C], is ", x.shape_str());
  const DType dt = compute_dtype(x, "rmsnorm_fwd: x");
  const int64_t rows = x.shape[0], cols = x.shape[1];
  MOP_CHECK(cols > 0, "rmsnorm_fwd: empty rows");
  expect(x, "rmsnorm_fwd: x", dt, {rows, cols});
  expect(y, "rmsnorm_fwd: y", dt, {rows, cols});
  expect(w, "rmsnorm_fwd: w", dt, {cols});
  expect(rstd, "rmsnorm_fwd: rstd", acc_dtype(dt), {rows});
  run(OpId::rmsnorm_fwd, &OpsBackend::rmsnorm_fwd, y, rstd, x, w, eps);
}

void Ops::rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                      const Tensor& rstd, bool accumulate_dx) {
  MOP_CHECK(x.ndim == 2, "rmsnorm_bwd: x must be [N,C], is ", x.shape_str());
  const DType dt = compute_dtype(x, "rmsnorm_bwd: x");
  const int64_t rows = x.shape[0], cols = x.shape[1];
  expect(x, "rmsnorm_bwd: x", dt, {rows, cols});
  expect(dx, "rmsnorm_bwd: dx", dt, {rows, cols});
  expect(dy, "rmsnorm_bwd: dy", dt, {rows, cols});
  expect(w, "rmsnorm_bwd: w", dt, {cols});
  expect(dw, "rmsnorm_bwd: dw", acc_dtype(dt), {cols});
  expect(rstd, "rmsnorm_bwd: rstd", acc_dtype(dt), {rows});
  run(OpId::rmsnorm_bwd, &OpsBackend::rmsnorm_bwd, dx, dw, dy, x, w, rstd, accumulate_dx);
}

}  // namespace mop
