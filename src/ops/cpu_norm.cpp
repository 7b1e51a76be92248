// CPU reference: RMSNorm forward/backward over the last dim, and rotary position embedding
// (rotate-half layout) with its inverse as the backward. Rows, tokens or column blocks are spread
// over OpenMP threads; each output element is computed by one thread in a fixed order.
#include <math.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu_ops.h"

namespace mop::cpu {
namespace {

// Columns per task when dw sums over rows: each thread owns whole columns of dw.
constexpr int64_t kDwColBlock = 64;

template <class T>
void rope_rotate(Tensor x, const Tensor& pos, float theta, bool inverse) {
  const int64_t num_tokens = x.shape[0], heads = x.shape[1], d = x.shape[2], half = d / 2;
  // Hugging Face parity: its rotary tables are inv_freq = 1/theta^(2i/D) and pos·inv_freq both in
  // fp32 (even for fp64 models), so those two steps round in float here too. cos/sin are then
  // evaluated in double and rounded once to T, i.e. correctly rounded cos/sin of that fp32 angle.
  std::vector<float> inv_freq(static_cast<size_t>(half));
  for (int64_t i = 0; i < half; ++i)
    inv_freq[size_t(i)] = 1.0f / ::powf(theta, float(2 * i) / float(d));
  const int32_t* p = pos.ptr<int32_t>();
#pragma omp parallel
  {
    std::vector<T> cs(static_cast<size_t>(half)), sn(static_cast<size_t>(half));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      for (int64_t i = 0; i < half; ++i) {
        const float angle = float(p[t]) * inv_freq[size_t(i)];
        cs[size_t(i)] = T(std::cos(double(angle)));
        // The inverse rotation is the rotation by −angle: cos is even, sin odd.
        sn[size_t(i)] = inverse ? -T(std::sin(double(angle))) : T(std::sin(double(angle)));
      }
      for (int64_t h = 0; h < heads; ++h) {
        T* row = x.ptr<T>() + (t * heads + h) * d;
        for (int64_t i = 0; i < half; ++i) {
          const T x1 = row[i], x2 = row[i + half];
          row[i] = x1 * cs[size_t(i)] - x2 * sn[size_t(i)];
          row[i + half] = x2 * cs[size_t(i)] + x1 * sn[size_t(i)];
        }
      }
    }
  }
}

void rope_apply(Tensor x, const Tensor& pos, float theta, bool inverse, const char* op) {
  DType dt = compute_dtype(x, op);
  MOP_CHECK(x.ndim == 3 && x.shape[2] % 2 == 0, op, ": x must be [T,heads,D] with D even, is ",
            x.shape_str());
  expect(x, "rope: x", dt, {x.shape[0], x.shape[1], x.shape[2]});
  expect(pos, "rope: pos", DType::I32, {x.shape[0]});
  MOP_CHECK(theta > 0, op, ": theta = ", theta);
  dispatch_float(dt, [&](auto tag) { rope_rotate<decltype(tag)>(x, pos, theta, inverse); });
}

}  // namespace

void rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) {
  DType dt = compute_dtype(x, "rmsnorm_fwd: x");
  MOP_CHECK(x.ndim == 2, "rmsnorm_fwd: x must be [N,C], is ", x.shape_str());
  const int64_t rows = x.shape[0], cols = x.shape[1];
  expect(y, "rmsnorm_fwd: y", dt, {rows, cols});
  expect(w, "rmsnorm_fwd: w", dt, {cols});
  expect(rstd, "rmsnorm_fwd: rstd", acc_dtype(dt), {rows});
  MOP_CHECK(cols > 0, "rmsnorm_fwd: empty rows");
  dispatch_float(dt, [&](auto tag) {
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

void rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                 const Tensor& rstd, bool accumulate_dx) {
  DType dt = compute_dtype(x, "rmsnorm_bwd: x");
  MOP_CHECK(x.ndim == 2, "rmsnorm_bwd: x must be [N,C], is ", x.shape_str());
  const int64_t rows = x.shape[0], cols = x.shape[1];
  expect(dx, "rmsnorm_bwd: dx", dt, {rows, cols});
  expect(dy, "rmsnorm_bwd: dy", dt, {rows, cols});
  expect(w, "rmsnorm_bwd: w", dt, {cols});
  expect(dw, "rmsnorm_bwd: dw", dt, {cols});
  expect(rstd, "rmsnorm_bwd: rstd", acc_dtype(dt), {rows});
  dispatch_float(dt, [&](auto tag) {
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

void rope_fwd(Tensor x, const Tensor& pos, float theta) {
  rope_apply(x, pos, theta, false, "rope_fwd");
}

void rope_bwd(Tensor dx, const Tensor& pos, float theta) {
  rope_apply(dx, pos, theta, true, "rope_bwd");
}

}  // namespace mop::cpu
