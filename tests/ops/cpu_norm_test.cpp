// CPU reference RMSNorm and RoPE: forwards against explicit formulas, finite-difference checks of
// both backwards (accumulate on and off), rope_bwd ∘ rope_fwd = identity, the fp32 angle rule of
// Hugging Face, and f32-vs-f64 agreement.
#include <math.h>

#include <cmath>
#include <complex>

#include "ops/ops_test_util.h"

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

TEST_CASE("rmsnorm forward equals x·w/sqrt(mean(x²)+eps)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t shapes[][2] = {{1, 1}, {7, 13}, {4, 64}};
  for (auto& s : shapes) {
    const int64_t n = s[0], c = s[1];
    const float eps = 1e-5f;
    HostTensor x = random_tensor(DType::F64, {n, c}, 1), w = random_tensor(DType::F64, {c}, 2);
    HostTensor y(DType::F64, {n, c}), rstd(DType::F64, {n});
    ops.rmsnorm_fwd(y, rstd, x, w, eps);
    double worst = 0;
    for (int64_t r = 0; r < n; ++r) {
      double ss = 0;
      for (int64_t j = 0; j < c; ++j) ss += x.get(r * c + j) * x.get(r * c + j);
      const double ref_rstd = 1 / std::sqrt(ss / double(c) + double(eps));
      worst = std::max(worst, std::fabs(rstd.get(r) - ref_rstd) / ref_rstd);
      for (int64_t j = 0; j < c; ++j)
        worst =
            std::max(worst, std::fabs(y.get(r * c + j) - x.get(r * c + j) * ref_rstd * w.get(j)));
    }
    INFO("n " << n << " c " << c);
    CHECK(max_abs(y) > 0);
    CHECK(worst < kFp64Tol);
  }
}

TEST_CASE("rmsnorm backward matches finite differences (fp64)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t shapes[][2] = {{1, 1}, {7, 13}, {3, 8}};
  for (auto& s : shapes)
    for (bool accumulate : {false, true}) {
      const int64_t n = s[0], c = s[1];
      INFO("n " << n << " c " << c << " accumulate_dx " << accumulate);
      const float eps = 1e-3f;  // large enough to matter for C = 1
      HostTensor x = random_tensor(DType::F64, {n, c}, 3), w = random_tensor(DType::F64, {c}, 4);
      HostTensor weights = random_tensor(DType::F64, {n, c}, 5);
      HostTensor y(DType::F64, {n, c}), rstd(DType::F64, {n});
      auto loss = [&] {
        ops.rmsnorm_fwd(y, rstd, x, w, eps);
        return weighted_sum(weights, y);
      };
      loss();
      // dw always accumulates and dx does when asked: start both from random values.
      HostTensor dx0 = random_tensor(DType::F64, {n, c}, 6),
                 dw0 = random_tensor(DType::F64, {c}, 7);
      HostTensor dx = dx0, dw = dw0;
      if (!accumulate) ops.fill(dx, std::nan(""));
      ops.rmsnorm_bwd(dx, dw, weights, x, w, rstd, accumulate);
      if (accumulate)
        for (int64_t i = 0; i < dx.numel(); ++i) dx.set(i, dx.get(i) - dx0.get(i));
      for (int64_t i = 0; i < dw.numel(); ++i) dw.set(i, dw.get(i) - dw0.get(i));
      check_grad("rmsnorm x", x, dx, loss);
      check_grad("rmsnorm w", w, dw, loss);
    }
}

TEST_CASE("rmsnorm in f32 agrees with f64; bit-identical with 1 and 2 threads", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t n = 37, c = 150;
  HostTensor x64 = bf16_exact_tensor(DType::F64, {n, c}, 8);
  HostTensor w64 = bf16_exact_tensor(DType::F64, {c}, 9);
  HostTensor dy64 = bf16_exact_tensor(DType::F64, {n, c}, 10);
  HostTensor outs[2][4];  // [f32, f64][y, rstd, dx, dw]
  for (int p = 0; p < 2; ++p) {
    const DType dt = p == 0 ? DType::F32 : DType::F64;
    HostTensor x = converted(x64, dt), w = converted(w64, dt), dy = converted(dy64, dt);
    HostTensor y(dt, {n, c}), rstd(dt, {n}), dx(dt, {n, c}), dw(dt, {c});
    ops.rmsnorm_fwd(y, rstd, x, w, 1e-6f);
    ops.rmsnorm_bwd(dx, dw, dy, x, w, rstd, false);
    outs[p][0] = y, outs[p][1] = rstd, outs[p][2] = dx, outs[p][3] = dw;
    HostTensor dx2(dt, {n, c}), dw2(dt, {c});
    with_threads(1, [&] { ops.rmsnorm_bwd(dx2, dw2, dy, x, w, rstd, false); });
    CHECK(bitwise_equal(dx, dx2));
    CHECK(bitwise_equal(dw, dw2));
  }
  for (int i = 0; i < 4; ++i) {
    INFO("output " << i);
    // dw sums 37 rows of O(1) terms: scale the tolerance by its magnitude.
    CHECK(max_abs_diff(outs[0][i], outs[1][i]) < kF32VsF64Tol * std::max(1.0, max_abs(outs[1][i])));
  }
}

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

TEST_CASE("rmsnorm and rope reject bad shapes and dtypes", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor x(DType::F32, {4, 6}), y(DType::F32, {4, 6}), w(DType::F32, {6}), r(DType::F32, {4});
  HostTensor w5(DType::F32, {5}), r64(DType::F64, {4}), xb(DType::BF16, {4, 6});
  CHECK_NOTHROW(ops.rmsnorm_fwd(y, r, x, w, 1e-6f));
  CHECK_THROWS_AS(ops.rmsnorm_fwd(y, r, x, w5, 1e-6f), Error);
  CHECK_THROWS_AS(ops.rmsnorm_fwd(y, r64, x, w, 1e-6f), Error);
  CHECK_THROWS_AS(ops.rmsnorm_fwd(y, r, xb, w, 1e-6f), Error);
  HostTensor q(DType::F32, {2, 1, 5}), q4(DType::F32, {2, 1, 4});
  HostTensor pos2 = positions({0, 1}), pos3 = positions({0, 1, 2});
  CHECK_NOTHROW(ops.rope_fwd(q4, pos2, 1e4f));
  CHECK_THROWS_AS(ops.rope_fwd(q, pos2, 1e4f), Error);  // odd head dim
  CHECK_THROWS_AS(ops.rope_fwd(q4, pos3, 1e4f), Error);
}
