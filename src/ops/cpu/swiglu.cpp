// CPU reference: SwiGLU, h = silu(g)·u over gu = [g | u], and its backward.
#include <cmath>

#include "ops/cpu/cpu.h"

namespace mop::cpu {

void CpuBackend::swiglu_fwd(Tensor h, const Tensor& gu) {
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  dispatch_float(gu.dtype, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gu.ptr<T>() + r * 2 * width;
      const T* u = g + width;
      T* out = h.ptr<T>() + r * width;
      for (int64_t c = 0; c < width; ++c) {
        T sig = T(1) / (T(1) + std::exp(-g[c]));
        out[c] = g[c] * sig * u[c];
      }
    }
  });
}

void CpuBackend::swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) {
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  // d silu(g)/dg = σ(g)·(1 + g·(1 − σ(g))). g and u are read before dg and du are written, so
  // dgu may alias gu.
  dispatch_float(gu.dtype, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gu.ptr<T>() + r * 2 * width;
      const T* u = g + width;
      const T* d = dh.ptr<T>() + r * width;
      T* dg = dgu.ptr<T>() + r * 2 * width;
      T* du = dg + width;
      for (int64_t c = 0; c < width; ++c) {
        T gc = g[c], uc = u[c];
        T sig = T(1) / (T(1) + std::exp(-gc));
        dg[c] = d[c] * uc * sig * (T(1) + gc * (T(1) - sig));
        du[c] = d[c] * gc * sig;
      }
    }
  });
}

}  // namespace mop::cpu
