// Front of the dense GEMM: its checks, then the backend's hook (cpu/gemm.cpp; cuda/gemm.cpp on
// cuBLASLt).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {

void Ops::gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha,
               float beta) {
  MOP_CHECK(a.ndim == 2 && b.ndim == 2 && c.ndim == 2, "gemm: a ", a.shape_str(), ", b ",
            b.shape_str(), ", c ", c.shape_str(), " must be matrices");
  const DType dt = compute_dtype(a, "gemm: a");
  const int64_t m = trans_a ? a.shape[1] : a.shape[0];
  const int64_t k = trans_a ? a.shape[0] : a.shape[1];
  const int64_t n = trans_b ? b.shape[0] : b.shape[1];
  const int64_t kb = trans_b ? b.shape[1] : b.shape[0];
  MOP_CHECK(k == kb, "gemm: inner dims differ: op(a) is [", m, ",", k, "], op(b) is [", kb, ",", n,
            "]");
  expect(a, "gemm: a", dt, {a.shape[0], a.shape[1]});
  expect(b, "gemm: b", dt, {b.shape[0], b.shape[1]});
  MOP_CHECK(c.dtype == dt || c.dtype == acc_dtype(dt), "gemm: c has dtype ", dtype_name(c.dtype),
            ", expected ", dtype_name(dt), " or ", dtype_name(acc_dtype(dt)));
  expect(c, "gemm: c", c.dtype, {m, n});
  MOP_CHECK(!overlap(c, a) && !overlap(c, b), "gemm: c must not alias a or b");
  run(OpId::gemm, &OpsBackend::gemm, c, a, trans_a, b, trans_b, alpha, beta);
}

}  // namespace mop
