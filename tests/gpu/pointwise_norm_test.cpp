// [gpu][pointwise] CudaOps RMSNorm (forward; backward with dx overwritten, accumulated and
// aliasing dy; dw accumulated and reproducible) and RoPE (forward, backward, round trip, the
// inverse-frequency table cache) against the CPU reference in fp32 on bf16-exact inputs. Row
// lengths cover every kernel path: 1, primes, non-multiples of 8, head_dim 128, hidden 2048, the
// register limit 4096, 16384, misaligned views, and enough rows that groups take several.
#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <vector>

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

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
// RoPE: the angle and the rotation are formed exactly as the reference does; only cos/sin can
// differ, by one fp32 ulp and rarely (fp64 sincos ≤ 2 ulp vs libm), moving y by ≤ 2^-24·(|x1|+|x2|)
// ≤ 2^-23 before the bf16 rounding.
constexpr double kRopeAtol = 1e-6;
// Fraction of RoPE outputs allowed to differ from the reference rounded to bf16 (see kRopeAtol).
constexpr double kRopeMaxInexact = 1e-3;
// rope_bwd(rope_fwd(x)): two bf16 roundings of a rotated pair, ≤ 2·2^-8·|(x1, x2)| ≤ 2^-6.5·max|x|.
constexpr double kRopeRoundTrip = 1.0 / 64;

struct NormShape {
  int64_t rows, cols, offset;
};
const NormShape kNormShapes[] = {{1, 1, 0},       {3, 7, 0},       {5, 8, 0},       {17, 128, 0},
                                 {4, 2048, 0},    {33, 1000, 0},   {3, 4096, 0},    {2, 16384, 0},
                                 {2, 16383, 0},   {3000, 13, 0},   {9, 64, 1},      {4096, 128, 0},
                                 {20000, 128, 0}, {2100, 2048, 0}, {300, 16384, 0}, {5, 4104, 0}};

HostTensor positions(int64_t tokens, uint64_t seed) {
  HostTensor p(DType::I32, {tokens});
  for (int64_t t = 0; t < tokens; ++t)
    p.ptr<int32_t>()[t] = t == 0 ? 0 : int32_t(philox_u64(seed, 1, uint64_t(t)) % 200000);
  return p;
}

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

#endif  // MOP_HAVE_CUDA
