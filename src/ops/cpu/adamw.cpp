// CPU reference AdamW step (torch.optim.AdamW's decoupled form) on fp32 param/m/v with an f32,
// f64 or bf16 gradient. It is the bit-exact reference for the SIMD host optimizer, so the float
// operations below are fixed: same operations, same order, each rounded to float, and no fused
// multiply-add (see the pragma). Elements are independent, so threading cannot change results.

// Contracting a·b + c into an FMA rounds once instead of twice and would change the bits whenever
// the build targets an FMA-capable ISA (-march=native). GCC ignores `#pragma STDC FP_CONTRACT`
// in C++, and the build flags are shared; this file-scope pragma applies to every function here
// (including OpenMP-outlined loop bodies; checked with g++ 12 -O3 -march=haswell: no vfmadd).
#pragma GCC optimize("fp-contract=off")

#include <cmath>

#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

inline float grad_to_float(float g) {
  return g;
}
inline float grad_to_float(double g) {
  return float(g);
}
inline float grad_to_float(bf16 g) {
  return bf16_to_float(g);
}

// Per element, in float, in this order (the constants are computed once per call, in float):
//   one_minus_beta1 = 1 − β1,  one_minus_beta2 = 1 − β2,  step_size = lr / bc1,
//   sqrt_bc2 = sqrt(bc2),      decay = 1 − lr·wd
//   g     = float(grad) · grad_scale
//   m     = β1·m + one_minus_beta1·g                  (two products, then the sum)
//   v     = β2·v + one_minus_beta2·(g·g)
//   denom = sqrt(v) / sqrt_bc2 + eps
//   param = param·decay − (step_size·m) / denom
template <class G>
void adamw_impl(float* param, float* m, float* v, const G* grad, int64_t n, const AdamWArgs& a) {
  const float one_minus_beta1 = 1.0f - a.beta1;
  const float one_minus_beta2 = 1.0f - a.beta2;
  const float step_size = a.lr / a.bias_correction1;
  const float sqrt_bc2 = std::sqrt(a.bias_correction2);
  const float decay = 1.0f - a.lr * a.weight_decay;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float g = grad_to_float(grad[i]) * a.grad_scale;
    const float mi = a.beta1 * m[i] + one_minus_beta1 * g;
    const float vi = a.beta2 * v[i] + one_minus_beta2 * (g * g);
    const float denom = std::sqrt(vi) / sqrt_bc2 + a.eps;
    param[i] = param[i] * decay - (step_size * mi) / denom;
    m[i] = mi;
    v[i] = vi;
  }
}

}  // namespace

void CpuBackend::adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                            const AdamWArgs& args) {
  const int64_t n = param.numel();
  switch (grad.dtype) {
    case DType::F32:
      adamw_impl(param.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.ptr<float>(), n, args);
      return;
    case DType::F64:
      adamw_impl(param.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.ptr<double>(), n, args);
      return;
    case DType::BF16:
      adamw_impl(param.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.ptr<bf16>(), n, args);
      return;
    default:
      MOP_CHECK(false, "adamw_step: grad dtype ", dtype_name(grad.dtype));
  }
}

}  // namespace mop::cpu
