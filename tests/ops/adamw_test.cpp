// adamw: the CPU reference AdamW bit-exact against a scalar formula whose every operation is
// rounded to float through a volatile (no FMA on either side), for f32, f64 and bf16 gradients,
// over several steps with weight decay and gradient scaling, and its preconditions; the CUDA
// backend bit-identical to the reference ([gpu]): zeros, subnormals, tiny and huge magnitudes,
// two hyper-parameter sets, aligned and misaligned views.

#include <cmath>

#include "ops/ops_test_util.h"

namespace reference {
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

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include <cstring>

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

namespace cuda {
using namespace mop;
using namespace mop::test;
using namespace mop::test::pw;

namespace {

// Full-precision doubles: every 16th a special value (zero, subnormal, tiny, huge), the rest
// sign · mantissa · 2^e with e in [lo_exp, hi_exp].
HostTensor spread_values(int64_t n, uint64_t seed, int lo_exp, int hi_exp, bool positive) {
  const double special[] = {0.0, 1e-42, -1e-30, 1e30, -1e20, 1e-45, 3.5e18, -0.0};
  HostTensor t(DType::F64, {n});
  for (int64_t i = 0; i < n; ++i) {
    const uint64_t r = philox_u64(seed, 9, uint64_t(i));
    double v;
    if (i % 16 == 5) {
      v = special[(i / 16) % 8];
    } else {
      const double mantissa = 1.0 + double(r >> 11) / 9007199254740992.0;
      const int e = lo_exp + int(philox_u64(seed, 10, uint64_t(i)) % uint64_t(hi_exp - lo_exp + 1));
      v = std::ldexp(mantissa, e) * ((r & 1) ? -1.0 : 1.0);
    }
    t.ptr<double>()[i] = positive ? std::fabs(v) : v;
  }
  return t;
}

// Same bits, or both NaN (NaN payloads differ between x86 and CUDA).
// Elements whose bits differ (NaN equals NaN), for f32 or bf16 tensors of the same dtype.
int64_t bit_mismatches(const HostTensor& a, const HostTensor& b) {
  REQUIRE(a.t.dtype == b.t.dtype);
  REQUIRE(a.numel() == b.numel());
  const size_t size = dtype_size(a.t.dtype);
  int64_t bad = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    const char* x = static_cast<const char*>(a.t.data) + size_t(i) * size;
    const char* y = static_cast<const char*>(b.t.data) + size_t(i) * size;
    if (std::memcmp(x, y, size) != 0 && !(std::isnan(a.get(i)) && std::isnan(b.get(i)))) ++bad;
  }
  return bad;
}

}  // namespace

TEST_CASE("adamw_step on the device is bit-identical to the reference", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  AdamWArgs a1;
  a1.lr = 3e-3f;
  a1.weight_decay = 0.1f;
  a1.grad_scale = 0.37f;
  AdamWArgs a2;
  a2.lr = 1e-4f;
  a2.beta1 = 0.8f;
  a2.beta2 = 0.999f;
  a2.eps = 1e-6f;
  for (const AdamWArgs& base : {a1, a2})
    for (DType grad_dt : {DType::F32, DType::BF16, DType::F64})
      for (int64_t n : {int64_t(1), int64_t(3), int64_t(1031), (int64_t(1) << 20) + 1})
        for (int64_t offset : {0, 1}) {
          INFO("lr " << base.lr << " grad " << dtype_name(grad_dt) << " n " << n << " offset "
                     << offset);
          HostTensor param = as_dtype(spread_values(n, 1, -30, 8, false), DType::F32);
          HostTensor m = as_dtype(spread_values(n, 2, -20, -2, false), DType::F32);
          HostTensor v = as_dtype(spread_values(n, 3, -40, -4, true), DType::F32);
          DeviceTensor d_param = upload_at(param, DType::F32, offset);
          DeviceTensor d_m = upload_at(m, DType::F32, offset);
          DeviceTensor d_v = upload_at(v, DType::F32, offset);
          AdamWArgs args = base;
          for (int step = 1; step <= 3; ++step) {
            INFO("step " << step);
            args.bias_correction1 = 1.0f - std::pow(args.beta1, float(step));
            args.bias_correction2 = 1.0f - std::pow(args.beta2, float(step));
            const HostTensor grad = as_dtype(spread_values(n, 10 + step, -12, 3, false), grad_dt);
            DeviceTensor d_grad = upload_at(grad, grad_dt, offset);
            cpu().adamw_step(param, m, v, grad, args);
            // Odd steps: the fused form that also writes the bf16 compute weights.
            DeviceTensor d_w = upload_at(param, DType::BF16, offset);
            test::poison(d_w.t);
            if (step % 2)
              ops.adamw_step_cast(d_param.t, d_m.t, d_v.t, d_grad.t, args, d_w.t);
            else
              ops.adamw_step(d_param.t, d_m.t, d_v.t, d_grad.t, args);
            if (step % 2) CHECK(bit_mismatches(download(d_w.t), as_dtype(param, DType::BF16)) == 0);
            CHECK(bit_mismatches(download(d_param.t), param) == 0);
            CHECK(bit_mismatches(download(d_m.t), m) == 0);
            CHECK(bit_mismatches(download(d_v.t), v) == 0);
          }
        }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
