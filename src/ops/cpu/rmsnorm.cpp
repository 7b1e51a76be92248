// CPU reference: RMSNorm forward/backward over the last dim. Rows or column blocks are spread over
// OpenMP threads; each output element is computed by one thread in a fixed order.
#include <math.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

// Columns per task when dw sums over rows: each thread owns whole columns of dw.
constexpr int64_t kDwColBlock = 64;

}  // namespace

void CpuBackend::rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* pw = w.ptr<T>();
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      const T* xr = x.ptr<T>() + n * cols;
      T ss = 0;
      for (int64_t c = 0; c < cols; ++c) ss += xr[c] * xr[c];
      const T r = T(1) / std::sqrt(ss / T(cols) + T(eps));
      rstd.ptr<T>()[n] = r;
      T* yr = y.ptr<T>() + n * cols;
      for (int64_t c = 0; c < cols; ++c) yr[c] = xr[c] * r * pw[c];
    }
  });
}

void CpuBackend::rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                             const Tensor& w, const Tensor& rstd, bool accumulate_dx) {
  const int64_t rows = x.shape[0], cols = x.shape[1];
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* pw = w.ptr<T>();
    const T* pr = rstd.ptr<T>();
    // dw[c] += Σ_n dy[n,c]·x[n,c]·rstd[n], rows in order. Runs before dx is written so that dx
    // may alias dy.
    const int64_t num_blocks = (cols + kDwColBlock - 1) / kDwColBlock;
#pragma omp parallel for schedule(static)
    for (int64_t blk = 0; blk < num_blocks; ++blk) {
      const int64_t c0 = blk * kDwColBlock, c1 = std::min(cols, c0 + kDwColBlock);
      T* pdw = dw.ptr<T>();
      for (int64_t n = 0; n < rows; ++n) {
        const T* xr = x.ptr<T>() + n * cols;
        const T* dyr = dy.ptr<T>() + n * cols;
        for (int64_t c = c0; c < c1; ++c) pdw[c] += dyr[c] * xr[c] * pr[n];
      }
    }
    // With g = dy·w and x̂ = x·r:  dx = r·(g − x̂·mean(g·x̂)), since ∂r/∂x_c = −r³·x_c/C.
#pragma omp parallel for schedule(static)
    for (int64_t n = 0; n < rows; ++n) {
      const T* xr = x.ptr<T>() + n * cols;
      const T* dyr = dy.ptr<T>() + n * cols;
      T* dxr = dx.ptr<T>() + n * cols;
      const T r = pr[n];
      T dot = 0;
      for (int64_t c = 0; c < cols; ++c) dot += dyr[c] * pw[c] * (xr[c] * r);
      const T mean_gx = dot / T(cols);
      for (int64_t c = 0; c < cols; ++c) {
        const T g = dyr[c] * pw[c];
        const T d = r * (g - xr[c] * r * mean_gx);
        dxr[c] = accumulate_dx ? dxr[c] + d : d;
      }
    }
  });
}

}  // namespace mop::cpu
