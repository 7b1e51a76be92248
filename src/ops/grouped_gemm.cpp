// Front of the grouped expert GEMMs: their checks (offsets are read here, in host memory), then
// the backend's hooks (cpu/grouped_gemm.cpp, cuda/grouped_gemm.cpp, kernels/grouped_gemm_sm90*).
#include <algorithm>

#include "core/error.h"
#include "ops/ops.h"

namespace mop {
namespace {

// offsets I32 [E+1] in host memory, 0 = o[0] ≤ … ≤ o[E] ≤ rows.
void check_offsets(const Tensor& offsets, int64_t num_experts, int64_t rows, const char* op) {
  MOP_CHECK(offsets.device == Device::CPU && offsets.dtype == DType::I32 && offsets.ndim == 1 &&
                offsets.shape[0] == num_experts + 1 && offsets.data,
            op, ": offsets must be host i32 [", num_experts + 1, "], is ",
            dtype_name(offsets.dtype), " ", offsets.shape_str());
  const int32_t* o = offsets.ptr<int32_t>();
  MOP_CHECK(o[0] == 0, op, ": offsets[0] = ", o[0]);
  for (int64_t e = 0; e < num_experts; ++e)
    MOP_CHECK(o[e] <= o[e + 1], op, ": offsets decrease at expert ", e);
  MOP_CHECK(o[num_experts] <= rows, op, ": offsets[E] = ", o[num_experts], " > ", rows, " rows");
}

}  // namespace

void Ops::grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets) {
  MOP_CHECK(w.ndim == 3 && x.ndim == 2 && y.ndim == 2, "grouped_gemm_fwd: w ", w.shape_str(),
            ", x ", x.shape_str(), ", y ", y.shape_str());
  const DType dt = compute_dtype(w, "grouped_gemm_fwd: w");
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  expect(w, "grouped_gemm_fwd: w", dt, {num_experts, n, k});
  expect(x, "grouped_gemm_fwd: x", dt, {x.shape[0], k});
  expect(y, "grouped_gemm_fwd: y", dt, {y.shape[0], n});
  check_offsets(offsets, num_experts, std::min(x.shape[0], y.shape[0]), "grouped_gemm_fwd");
  run(OpId::grouped_gemm_fwd, &OpsBackend::grouped_gemm_fwd, y, x, w, offsets);
}

void Ops::grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w,
                                const Tensor& offsets) {
  MOP_CHECK(w.ndim == 3 && dx.ndim == 2 && dy.ndim == 2, "grouped_gemm_bwd_data: w ", w.shape_str(),
            ", dx ", dx.shape_str(), ", dy ", dy.shape_str());
  const DType dt = compute_dtype(w, "grouped_gemm_bwd_data: w");
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  expect(w, "grouped_gemm_bwd_data: w", dt, {num_experts, n, k});
  expect(dx, "grouped_gemm_bwd_data: dx", dt, {dx.shape[0], k});
  expect(dy, "grouped_gemm_bwd_data: dy", dt, {dy.shape[0], n});
  check_offsets(offsets, num_experts, std::min(dx.shape[0], dy.shape[0]), "grouped_gemm_bwd_data");
  run(OpId::grouped_gemm_bwd_data, &OpsBackend::grouped_gemm_bwd_data, dx, dy, w, offsets);
}

void Ops::grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x,
                                  const Tensor& offsets, bool accumulate) {
  MOP_CHECK(dw.ndim == 3 && x.ndim == 2 && dy.ndim == 2, "grouped_gemm_bwd_weight: dw ",
            dw.shape_str(), ", x ", x.shape_str(), ", dy ", dy.shape_str());
  const DType dt = compute_dtype(x, "grouped_gemm_bwd_weight: x");
  const int64_t num_experts = dw.shape[0], n = dw.shape[1], k = dw.shape[2];
  expect(dw, "grouped_gemm_bwd_weight: dw", acc_dtype(dt), {num_experts, n, k});
  expect(x, "grouped_gemm_bwd_weight: x", dt, {x.shape[0], k});
  expect(dy, "grouped_gemm_bwd_weight: dy", dt, {dy.shape[0], n});
  check_offsets(offsets, num_experts, std::min(x.shape[0], dy.shape[0]), "grouped_gemm_bwd_weight");
  run(OpId::grouped_gemm_bwd_weight, &OpsBackend::grouped_gemm_bwd_weight, dw, dy, x, offsets,
      accumulate);
}

}  // namespace mop
