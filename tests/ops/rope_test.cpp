// rope: the CPU reference rotates (x_i, x_{i+D/2}) by pos·theta^(-2i/D) with fp32 angles (Hugging
// Face's rule), its backward inverts it and matches finite differences; the CUDA backend ([gpu])
// forward, backward, round trip and the inverse-frequency table cache.

#include <cmath>
#include <complex>
#include <math.h>

#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

HostTensor positions(std::initializer_list<int32_t> values) {
  HostTensor p(DType::I32, {int64_t(values.size())});
  int64_t i = 0;
  for (int32_t v : values) p.ptr<int32_t>()[i++] = v;
  return p;
}

// Reference rotation of one [T,heads,D] tensor written as complex multiplication of the pairs
// (x[i], x[i + D/2]) by e^{i·angle}, with the angle formed as the op's contract says (fp32).
HostTensor reference_rope(const HostTensor& x, const HostTensor& pos, float theta) {
  HostTensor y = x;
  const int64_t tokens = x.t.shape[0], heads = x.t.shape[1], d = x.t.shape[2], half = d / 2;
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t i = 0; i < half; ++i) {
      const float inv_freq = 1.0f / ::powf(theta, float(2 * i) / float(d));
      const double angle = double(float(pos.ptr<int32_t>()[t]) * inv_freq);
      const std::complex<double> rot = std::polar(1.0, angle);
      for (int64_t h = 0; h < heads; ++h) {
        const int64_t base = (t * heads + h) * d;
        std::complex<double> z(x.get(base + i), x.get(base + i + half));
        z *= rot;
        y.set(base + i, z.real());
        y.set(base + i + half, z.imag());
      }
    }
  return y;
}

}  // namespace

TEST_CASE("rope forward rotates (x_i, x_{i+D/2}) by pos·theta^(-2i/D) with fp32 angles",
          "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // D = 2: one pair with inv_freq = 1, so the angle is the position itself.
  {
    HostTensor x(DType::F64, {3, 1, 2});
    for (int64_t i = 0; i < 6; ++i) x.set(i, i % 2 ? 0.0 : 1.0);  // (1, 0) per token
    HostTensor pos = positions({0, 1, 5});
    ops.rope_fwd(x, pos, 10000.0f);
    for (int t = 0; t < 3; ++t) {
      const double angle = double(pos.ptr<int32_t>()[t]);
      CHECK(x.get(2 * t) == std::cos(angle));
      CHECK(x.get(2 * t + 1) == std::sin(angle));
    }
  }
  // Several heads, D = 6, positions that restart (packed sequences) and one far out, where the
  // fp32 angle differs visibly from an fp64 one.
  const float theta = 1e6f;
  HostTensor pos = positions({0, 3, 1, 0, 2, 123457});
  HostTensor x = random_tensor(DType::F64, {6, 3, 6}, 11);
  HostTensor ref = reference_rope(x, pos, theta);
  HostTensor y = x;
  ops.rope_fwd(y, pos, theta);
  CHECK(max_abs_diff(y, ref) < kFp64Tol);
  for (int64_t i = 0; i < 3 * 6; ++i) CHECK(y.get(i) == x.get(i));  // position 0 is identity
  // The fp64-angle rotation of the last token is measurably different: the test sees the rule.
  const int64_t last = 5 * 3 * 6;
  const double angle64 = 123457.0 / std::pow(1e6, 2.0 / 6.0);
  const double x1 = x.get(last + 1), x2 = x.get(last + 1 + 3);
  CHECK(std::fabs(y.get(last + 1) - (x1 * std::cos(angle64) - x2 * std::sin(angle64))) > 1e-9);
}

TEST_CASE("rope backward inverts forward and matches finite differences", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const float theta = 10000.0f;
  HostTensor pos = positions({4, 0, 9, 2, 2, 31, 7});
  HostTensor x = random_tensor(DType::F64, {7, 2, 8}, 12);
  HostTensor y = x;
  ops.rope_fwd(y, pos, theta);
  CHECK(max_abs_diff(y, x) > 0.1);
  ops.rope_bwd(y, pos, theta);
  CHECK(max_abs_diff(y, x) < kFp64Tol);

  HostTensor weights = random_tensor(DType::F64, {7, 2, 8}, 13);
  HostTensor work = x;
  auto loss = [&] {
    ops.copy(work, x);
    ops.rope_fwd(work, pos, theta);
    return weighted_sum(weights, work);
  };
  HostTensor dx = weights;
  ops.rope_bwd(dx, pos, theta);
  check_grad("rope x", x, dx, loss);

  HostTensor x32 = converted(x, DType::F32);
  ops.rope_fwd(x32, pos, theta);
  work = x;
  ops.rope_fwd(work, pos, theta);
  CHECK(max_abs_diff(x32, work) < kF32VsF64Tol);
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <vector>

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

namespace cuda {
using namespace mop;
using namespace mop::test;
using namespace mop::test::pw;

namespace {

// RoPE: the angle and the rotation are formed exactly as the reference does; only cos/sin can
// differ, by one fp32 ulp and rarely (fp64 sincos ≤ 2 ulp vs libm), moving y by ≤ 2^-24·(|x1|+|x2|)
// ≤ 2^-23 before the bf16 rounding.
constexpr double kRopeAtol = 1e-6;
// Fraction of RoPE outputs allowed to differ from the reference rounded to bf16 (see kRopeAtol).
constexpr double kRopeMaxInexact = 1e-3;
// rope_bwd(rope_fwd(x)): two bf16 roundings of a rotated pair, ≤ 2·2^-8·|(x1, x2)| ≤ 2^-6.5·max|x|.
constexpr double kRopeRoundTrip = 1.0 / 64;

HostTensor positions(int64_t tokens, uint64_t seed) {
  HostTensor p(DType::I32, {tokens});
  for (int64_t t = 0; t < tokens; ++t)
    p.ptr<int32_t>()[t] = t == 0 ? 0 : int32_t(philox_u64(seed, 1, uint64_t(t)) % 200000);
  return p;
}

void check_close(const HostTensor& got, const HostTensor& ref, double atol, double rtol,
                 const char* what) {
  std::string first;
  const int64_t bad = mismatches(got, ref, atol, rtol, &first);
  INFO(what << ": " << bad << " mismatches, first " << first);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("rope forward and backward on the device match the reference", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const int64_t shapes[][4] = {{1, 1, 2, 0},     {3, 2, 6, 0},   {5, 3, 16, 0},   {7, 4, 128, 0},
                               {64, 32, 128, 0}, {4, 2, 250, 0}, {33, 4, 128, 0}, {9, 1, 128, 1},
                               {2, 3, 8192, 0},  {100, 1, 64, 0}};
  for (auto& s : shapes)
    for (float theta : {10000.0f, 1000000.0f}) {
      const int64_t tokens = s[0], heads = s[1], dim = s[2], offset = s[3];
      INFO("x [" << tokens << "," << heads << "," << dim << "] offset " << offset << " theta "
                 << theta);
      const HostTensor x = random_f32({tokens, heads, dim}, 31, -1, 1);
      const HostTensor pos = positions(tokens, 32);
      DeviceTensor d_pos = upload_at(pos, DType::I32);
      for (bool inverse : {false, true}) {
        INFO((inverse ? "rope_bwd" : "rope_fwd"));
        HostTensor ref = x;
        if (inverse)
          cpu().rope_bwd(ref, pos, theta);
        else
          cpu().rope_fwd(ref, pos, theta);
        DeviceTensor d_x = upload_at(x, DType::BF16, offset);
        if (inverse)
          ops.rope_bwd(d_x.t, d_pos.t, theta);
        else
          ops.rope_fwd(d_x.t, d_pos.t, theta);
        const HostTensor got = download(d_x.t);
        check_close(got, ref, kRopeAtol, kBf16Rtol, "rotation");
        const HostTensor ref_bf16 = as_dtype(ref, DType::BF16);
        int64_t inexact = 0;
        for (int64_t i = 0; i < got.numel(); ++i)
          inexact += got.ptr<uint16_t>()[i] != ref_bf16.ptr<uint16_t>()[i];
        CHECK(double(inexact) <= kRopeMaxInexact * double(got.numel()));
      }
      DeviceTensor d_x = upload_at(x, DType::BF16, offset);
      ops.rope_fwd(d_x.t, d_pos.t, theta);
      ops.rope_bwd(d_x.t, d_pos.t, theta);
      check_close(download(d_x.t), x, kRopeRoundTrip, 0, "rope_bwd(rope_fwd(x))");
    }
}

TEST_CASE("rope keeps inverse-frequency tables for many (theta, dim) pairs", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  // More distinct pairs than cached slots, then the first ones again (evicted and rebuilt).
  for (int round = 0; round < 2; ++round)
    for (int k = 0; k < 12; ++k) {
      const float theta = 500.0f * float(k + 1);
      const int64_t dim = k % 2 ? 128 : 16;
      INFO("round " << round << " theta " << theta << " dim " << dim);
      const HostTensor x = random_f32({6, 2, dim}, 40 + k, -1, 1);
      const HostTensor pos = positions(6, 41 + k);
      HostTensor ref = x;
      cpu().rope_fwd(ref, pos, theta);
      DeviceTensor d_x = upload_at(x, DType::BF16), d_pos = upload_at(pos, DType::I32);
      ops.rope_fwd(d_x.t, d_pos.t, theta);
      check_close(download(d_x.t), ref, kRopeAtol, kBf16Rtol, "rotation");
    }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
