// CPU reference: the grouped expert GEMMs (forward, backward data, backward weight) as one dense
// GEMM per expert over its rows (cpu/gemm.h). The front has checked the offsets.
#include <algorithm>

#include "ops/cpu/cpu.h"
#include "ops/cpu/gemm.h"

namespace mop::cpu {

void CpuBackend::grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w,
                                  const Tensor& offsets) {
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  const int32_t* o = offsets.ptr<int32_t>();
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t rows = o[e + 1] - o[e];
      if (rows == 0) continue;
      // y_e[rows,n] = x_e[rows,k] · w_eᵀ (w_e is [n,k]).
      gemm_op(y.ptr<T>() + o[e] * n, x.ptr<T>() + o[e] * k, false, w.ptr<T>() + e * n * k, true,
              rows, n, k, T(1), T(0));
    }
  });
}

void CpuBackend::grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w,
                                       const Tensor& offsets) {
  const int64_t num_experts = w.shape[0], n = w.shape[1], k = w.shape[2];
  const int32_t* o = offsets.ptr<int32_t>();
  dispatch_float(dy.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t rows = o[e + 1] - o[e];
      if (rows == 0) continue;
      // dx_e[rows,k] = dy_e[rows,n] · w_e[n,k].
      gemm_op(dx.ptr<T>() + o[e] * k, dy.ptr<T>() + o[e] * n, false, w.ptr<T>() + e * n * k, false,
              rows, k, n, T(1), T(0));
    }
  });
}

void CpuBackend::grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x,
                                         const Tensor& offsets, bool accumulate) {
  const int64_t num_experts = dw.shape[0], n = dw.shape[1], k = dw.shape[2];
  const int32_t* o = offsets.ptr<int32_t>();
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t e = 0; e < num_experts; ++e) {
      const int64_t rows = o[e + 1] - o[e];
      T* dw_e = dw.ptr<T>() + e * n * k;
      if (rows == 0) {  // dw_e += 0, or dw_e = 0
        if (!accumulate) std::fill(dw_e, dw_e + n * k, T(0));
        continue;
      }
      // dw_e[n,k] (+)= dy_e[rows,n]ᵀ · x_e[rows,k]: the kernel's sums start from dw_e or from 0.
      gemm_op(dw_e, dy.ptr<T>() + o[e] * n, true, x.ptr<T>() + o[e] * k, false, n, k, rows, T(1),
              T(accumulate ? 1 : 0));
    }
  });
}

}  // namespace mop::cpu
