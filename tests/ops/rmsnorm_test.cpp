// rmsnorm: the CPU reference forward against the formula, backward against finite differences
// (accumulate on and off), f32-vs-f64 agreement, thread-count independence; the CUDA backend
// ([gpu]) in fp32 on bf16-exact inputs over every kernel path (rows of 1, primes, head_dim 128,
// hidden 2048, 4096, 16384, misaligned views), dx aliasing dy, dw reproducible.

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

// rstd from fp32 sums of C squares in two orders (the reference's is sequential): a few 2^-24
// per √C terms, ≤ ~1e-5 relative at C = 16384; 4e-5 leaves a margin.
constexpr double kRstdRtol = 4e-5;
// y = bf16(x·rstd·w): the bf16 rounding plus rstd's difference.
constexpr double kNormRtol = kBf16Rtol + kRstdRtol;
// dx's inner fp32 terms differ by summation order only in mean(g·x̂), which moves dx by ~2^-24 of
// its scale; 1e-5 of the largest |dx| (plus the bf16 rounding as rtol) is generous.
constexpr double kDxAtolScale = 1e-5;
// dw sums N fp32 terms in other orders: the difference is a few 2^-24 of Σ|term| (random-sign
// terms), 1e-5 of |dw₀| + Σ|dy·x·rstd| bounds it with room.
constexpr double kDwRtol = 1e-5;

struct NormShape {
  int64_t rows, cols, offset;
};
const NormShape kNormShapes[] = {{1, 1, 0},       {3, 7, 0},       {5, 8, 0},       {17, 128, 0},
                                 {4, 2048, 0},    {33, 1000, 0},   {3, 4096, 0},    {2, 16384, 0},
                                 {2, 16383, 0},   {3000, 13, 0},   {9, 64, 1},      {4096, 128, 0},
                                 {20000, 128, 0}, {2100, 2048, 0}, {300, 16384, 0}, {5, 4104, 0}};

double largest(const HostTensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::fabs(t.get(i)));
  return m;
}

void check_close(const HostTensor& got, const HostTensor& ref, double atol, double rtol,
                 const char* what) {
  std::string first;
  const int64_t bad = mismatches(got, ref, atol, rtol, &first);
  INFO(what << ": " << bad << " mismatches, first " << first);
  CHECK(bad == 0);
}

}  // namespace

TEST_CASE("rmsnorm forward on the device matches the reference", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const float eps = 1e-6f;
  for (const NormShape& s : kNormShapes) {
    INFO("rows " << s.rows << " cols " << s.cols << " offset " << s.offset);
    const HostTensor x = random_f32({s.rows, s.cols}, 21, -2, 2);
    const HostTensor w = random_f32({s.cols}, 22, -1.5, 1.5);
    HostTensor y_ref(DType::F32, {s.rows, s.cols}), rstd_ref(DType::F32, {s.rows});
    cpu().rmsnorm_fwd(y_ref, rstd_ref, x, w, eps);
    DeviceTensor dx = upload_at(x, DType::BF16, s.offset), dw = upload_at(w, DType::BF16, s.offset);
    DeviceTensor y = poisoned(DType::BF16, {s.rows, s.cols}, s.offset);
    DeviceTensor rstd = poisoned(DType::F32, {s.rows});
    ops.rmsnorm_fwd(y.t, rstd.t, dx.t, dw.t, eps);
    check_close(download(y.t), y_ref, 1e-6, kNormRtol, "y");
    check_close(download(rstd.t), rstd_ref, 0, kRstdRtol, "rstd");
  }
}

TEST_CASE("rmsnorm backward on the device matches the reference and is reproducible",
          "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const float eps = 1e-6f;
  for (const NormShape& s : kNormShapes)
    for (bool accumulate : {false, true}) {
      INFO("rows " << s.rows << " cols " << s.cols << " offset " << s.offset << " accumulate "
                   << accumulate);
      const HostTensor x = random_f32({s.rows, s.cols}, 21, -2, 2);
      const HostTensor w = random_f32({s.cols}, 22, -1.5, 1.5);
      const HostTensor dy = random_f32({s.rows, s.cols}, 23, -1, 1);
      const HostTensor dx0 = random_f32({s.rows, s.cols}, 24, -1, 1);
      const HostTensor dw0 = random_f32({s.cols}, 25, -1, 1);
      HostTensor y_ref(DType::F32, {s.rows, s.cols}), rstd(DType::F32, {s.rows});
      cpu().rmsnorm_fwd(y_ref, rstd, x, w, eps);
      HostTensor dx_ref = dx0, dw_ref = dw0;
      cpu().rmsnorm_bwd(dx_ref, dw_ref, dy, x, w, rstd, accumulate);
      // Σ_n |dy·x·rstd| per column: the scale of dw's rounding differences.
      std::vector<double> dw_scale(size_t(s.cols), 0.0);
      for (int64_t n = 0; n < s.rows; ++n)
        for (int64_t c = 0; c < s.cols; ++c)
          dw_scale[size_t(c)] +=
              std::fabs(dy.get(n * s.cols + c) * x.get(n * s.cols + c) * rstd.get(n));

      DeviceTensor d_x = upload_at(x, DType::BF16, s.offset);
      DeviceTensor d_w = upload_at(w, DType::BF16, s.offset);
      DeviceTensor d_dy = upload_at(dy, DType::BF16, s.offset);
      DeviceTensor d_rstd = upload_at(rstd, DType::F32);
      auto run = [&](HostTensor& dx_out, HostTensor& dw_out) {
        DeviceTensor d_dx = accumulate ? upload_at(dx0, DType::BF16, s.offset)
                                       : poisoned(DType::BF16, {s.rows, s.cols}, s.offset);
        DeviceTensor d_dw = upload_at(dw0, DType::F32);
        ops.rmsnorm_bwd(d_dx.t, d_dw.t, d_dy.t, d_x.t, d_w.t, d_rstd.t, accumulate);
        dx_out = download(d_dx.t);
        dw_out = download(d_dw.t);
      };
      HostTensor dx, dw, dx2, dw2;
      run(dx, dw);
      check_close(dx, dx_ref, kDxAtolScale * largest(dx_ref) + 1e-6, kBf16Rtol, "dx");
      int64_t bad_dw = 0;
      for (int64_t c = 0; c < s.cols; ++c)
        if (!(std::fabs(dw.get(c) - dw_ref.get(c)) <=
              kDwRtol * (std::fabs(dw0.get(c)) + dw_scale[size_t(c)]) + 1e-7))
          ++bad_dw;
      CHECK(bad_dw == 0);
      run(dx2, dw2);
      CHECK(bitwise_equal(dx, dx2));
      CHECK(bitwise_equal(dw, dw2));
      if (!accumulate) {  // dx may be dy itself
        DeviceTensor alias = upload_at(dy, DType::BF16, s.offset);
        DeviceTensor d_dw = upload_at(dw0, DType::F32);
        ops.rmsnorm_bwd(alias.t, d_dw.t, alias.t, d_x.t, d_w.t, d_rstd.t, false);
        CHECK(bitwise_equal(download(alias.t), dx));
        CHECK(bitwise_equal(download(d_dw.t), dw));
      }
    }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
