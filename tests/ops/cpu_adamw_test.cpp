// CPU reference AdamW: bit-exact against a scalar formula whose every operation is rounded to
// float through a volatile (so neither side can fuse into FMA), for f32, f64 and bf16 gradients,
// over several steps with weight decay and gradient scaling; plus its preconditions.
#include <cmath>

#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

// The op's documented order: g = float(grad)·scale; m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·(g·g);
// param = param·(1 − lr·wd) − ((lr/bc1)·m) / (sqrt(v)/sqrt(bc2) + eps).
void reference_step(float& param, float& m, float& v, float grad, const AdamWArgs& a) {
  volatile float one_minus_beta1 = 1.0f - a.beta1, one_minus_beta2 = 1.0f - a.beta2;
  volatile float step_size = a.lr / a.bias_correction1;
  volatile float sqrt_bc2 = std::sqrt(a.bias_correction2);
  volatile float lr_wd = a.lr * a.weight_decay;
  volatile float decay = 1.0f - lr_wd;
  volatile float g = grad * a.grad_scale;
  volatile float m1 = a.beta1 * m, m2 = one_minus_beta1 * g;
  volatile float m_new = m1 + m2;
  volatile float gg = g * g;
  volatile float v1 = a.beta2 * v, v2 = one_minus_beta2 * gg;
  volatile float v_new = v1 + v2;
  volatile float root = std::sqrt(v_new);
  volatile float scaled = root / sqrt_bc2;
  volatile float denom = scaled + a.eps;
  volatile float num = step_size * m_new;
  volatile float update = num / denom;
  volatile float decayed = param * decay;
  param = decayed - update;
  m = m_new;
  v = v_new;
}

}  // namespace

TEST_CASE("adamw_step is bit-exact with the documented float formula", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t n = 1031;
  for (DType grad_dt : {DType::F32, DType::F64, DType::BF16}) {
    INFO("grad " << dtype_name(grad_dt));
    HostTensor param = random_tensor(DType::F32, {n}, 1),
               m = random_tensor(DType::F32, {n}, 2, -0.1, 0.1);
    HostTensor v = random_tensor(DType::F32, {n}, 3, 0, 0.01);
    HostTensor ref_p = param, ref_m = m, ref_v = v;
    AdamWArgs args;
    args.lr = 3e-3f;
    args.weight_decay = 0.1f;
    args.grad_scale = 0.37f;
    for (int step = 1; step <= 3; ++step) {
      args.bias_correction1 = 1.0f - std::pow(args.beta1, float(step));
      args.bias_correction2 = 1.0f - std::pow(args.beta2, float(step));
      HostTensor grad = random_tensor(grad_dt, {n}, 10 + step, -2, 2);
      ops.adamw_step(param, m, v, grad, args);
      for (int64_t i = 0; i < n; ++i) {
        // f64 gradients are rounded to float first; bf16 and f32 are exact in float.
        const float g = grad_dt == DType::F64 ? float(grad.ptr<double>()[i]) : float(grad.get(i));
        reference_step(ref_p.ptr<float>()[i], ref_m.ptr<float>()[i], ref_v.ptr<float>()[i], g,
                       args);
      }
      INFO("step " << step);
      CHECK(bitwise_equal(param, ref_p));
      CHECK(bitwise_equal(m, ref_m));
      CHECK(bitwise_equal(v, ref_v));
    }
    CHECK(max_abs_diff(param, random_tensor(DType::F32, {n}, 1)) > 1e-3);  // it moved
  }
}

TEST_CASE("adamw_step rejects non-f32 state and mismatched sizes", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor p(DType::F32, {8}), m(DType::F32, {8}), v(DType::F32, {8}), g(DType::BF16, {8});
  AdamWArgs args;
  args.lr = 1e-3f;
  CHECK_NOTHROW(ops.adamw_step(p, m, v, g, args));
  HostTensor p64(DType::F64, {8}), g7(DType::F32, {7}), gi(DType::I32, {8});
  CHECK_THROWS_AS(ops.adamw_step(p64, m, v, g, args), Error);
  CHECK_THROWS_AS(ops.adamw_step(p, m, v, g7, args), Error);
  CHECK_THROWS_AS(ops.adamw_step(p, m, v, gi, args), Error);
  args.bias_correction2 = 0;
  CHECK_THROWS_AS(ops.adamw_step(p, m, v, g, args), Error);
}
