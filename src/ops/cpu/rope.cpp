// CPU reference: rotary position embedding (rotate-half layout) in place, with the inverse
// rotation as the backward. Tokens are spread over OpenMP threads.
#include <math.h>

#include <cmath>
#include <vector>

#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

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

void rope_apply(Tensor x, const Tensor& pos, float theta, bool inverse) {
  dispatch_float(x.dtype, [&](auto tag) { rope_rotate<decltype(tag)>(x, pos, theta, inverse); });
}

}  // namespace

void CpuBackend::rope_fwd(Tensor x, const Tensor& pos, float theta) {
  rope_apply(x, pos, theta, false);
}

void CpuBackend::rope_bwd(Tensor dx, const Tensor& pos, float theta) {
  rope_apply(dx, pos, theta, true);
}

}  // namespace mop::cpu
