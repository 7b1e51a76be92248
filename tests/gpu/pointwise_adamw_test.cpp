// [gpu][pointwise] CudaOps adamw_step is bit-identical to the CPU reference: f32, bf16 and f64
// gradients; zeros, subnormals, tiny and huge magnitudes (g² overflowing to infinity); several
// steps, two hyper-parameter sets, aligned and misaligned views (vector and scalar paths).
#ifdef MOP_HAVE_CUDA

#include <cmath>
#include <cstring>

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

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

#endif  // MOP_HAVE_CUDA
