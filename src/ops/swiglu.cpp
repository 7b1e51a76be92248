// Front of SwiGLU (h = silu(g)·u, gu = [g | u]) and its backward: the checks, then the backend's
// hooks (cpu/swiglu.cpp, cuda/swiglu.cpp, kernels/swiglu.cu).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {
void Ops::swiglu_fwd(Tensor h, const Tensor& gu) {
  MOP_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0, "swiglu_fwd: gu must be [M,2F], is ",
            gu.shape_str());
  const DType dt = compute_dtype(gu, "swiglu_fwd: gu");
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  expect(gu, "swiglu_fwd: gu", dt, {rows, 2 * width});
  expect(h, "swiglu_fwd: h", dt, {rows, width});
  MOP_CHECK(!overlap(h, gu), "swiglu_fwd: h overlaps gu");
  run(OpId::swiglu_fwd, &OpsBackend::swiglu_fwd, h, gu);
}

void Ops::swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) {
  MOP_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0, "swiglu_bwd: gu must be [M,2F], is ",
            gu.shape_str());
  const DType dt = compute_dtype(gu, "swiglu_bwd: gu");
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  expect(gu, "swiglu_bwd: gu", dt, {rows, 2 * width});
  expect(dh, "swiglu_bwd: dh", dt, {rows, width});
  expect(dgu, "swiglu_bwd: dgu", dt, {rows, 2 * width});
  // dgu may be gu itself (each element is read before it is written) but not overlap it otherwise.
  MOP_CHECK(dgu.data == gu.data || !overlap(dgu, gu), "swiglu_bwd: dgu partly overlaps gu");
  MOP_CHECK(!overlap(dgu, dh), "swiglu_bwd: dgu overlaps dh");
  run(OpId::swiglu_bwd, &OpsBackend::swiglu_bwd, dgu, dh, gu);
}

}  // namespace mop
