// [gpu][pointwise] CudaOps fill, copy (device dtype conversion), add, sum/sumsq and SwiGLU against
// the CPU reference: bitwise where both sides round the same exact value once (fill, conversion
// incl. ties and subnormals, add), named tolerances elsewhere. Sizes 1, primes, non-multiples of
// every vector width and 10^7 elements; views at an odd offset take the scalar paths.
#ifdef MOP_HAVE_CUDA

#include <cmath>
#include <vector>

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

using namespace mop;
using namespace mop::test;
using namespace mop::test::pw;

namespace {

const int64_t kSizes[] = {1, 7, 13, 4099, 1000003};

// sum/sumsq: the GPU pairs bf16 terms in fp32 (one rounding, 2^-24 of the pair's magnitude) and
// otherwise adds in fp64; the reference adds in fp64. Both round the total once to f32 (2^-24).
// So they differ by at most ~3·2^-24 ≈ 1.8e-7 of Σ|term|; 4e-7 leaves a margin.
constexpr double kReduceRtol = 4e-7;

// SwiGLU in fp32 on both sides, with the GPU's fast exponential (≤ ~6 ulp for |x| ≤ 4): values
// agree to ~1e-6 relative before the bf16 rounding.
constexpr double kSwigluRtol = kBf16Rtol + 1e-5;
// dg's factor 1 + g·(1 − σ) cancels near g ≈ −1.28, where σ's ~1e-6 relative error times
// |dh·u·g| ≤ 4·4·1.3 leaves ~2e-5 absolute at most; 1e-4 absolute covers it.
constexpr double kSwigluAtol = 1e-4;

// Doubles that exercise every rounding case of f64 → f32/bf16 and f32 → bf16: exact ties, values
// just off a tie (where rounding through f32 first would go wrong), signed zeros, f32/bf16
// subnormals, overflow to infinity, then random values with full 53-bit mantissas over a wide
// exponent range.
HostTensor tricky_values(int64_t n, uint64_t seed) {
  const double special[] = {0.0,
                            -0.0,
                            1.0 + std::ldexp(1.0, -8),      // bf16 tie → 1 (even)
                            1.0 + 3 * std::ldexp(1.0, -8),  // bf16 tie → up (even)
                            1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40),
                            1.0 + std::ldexp(1.0, -8) - std::ldexp(1.0, -40),
                            -(1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -30)),
                            1.0 + std::ldexp(1.0, -24) + std::ldexp(1.0, -60),
                            1e-40,
                            std::ldexp(1.0, -130),
                            -std::ldexp(1.0, -135),
                            std::ldexp(3.0, -134),
                            1e300,
                            -1e300,
                            3.4e38,
                            65504.0};
  HostTensor t(DType::F64, {n});
  const int64_t num_special = int64_t(sizeof(special) / sizeof(special[0]));
  for (int64_t i = 0; i < n; ++i) {
    if (i < num_special) {
      t.ptr<double>()[i] = special[i];
      continue;
    }
    const uint64_t r = philox_u64(seed, 3, uint64_t(i));
    const double mantissa = 1.0 + double(r >> 11) / 9007199254740992.0;
    const int exponent = int(philox_u64(seed, 4, uint64_t(i)) % 281) - 140;
    t.ptr<double>()[i] = ((r & 1) ? -1.0 : 1.0) * std::ldexp(mantissa, exponent);
  }
  return t;
}

// Σ x and Σ |x| (or Σ x² twice) in fp64, in index order: the reference's sum and the scale of its
// rounding error.
void reference_reduce(const HostTensor& x, bool square, double& sum, double& scale) {
  sum = scale = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double v = x.get(i);
    sum += square ? v * v : v;
    scale += square ? v * v : std::fabs(v);
  }
}

}  // namespace

TEST_CASE("fill on the device writes the reference's bit pattern", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  // 1 + 2^-8 + 2^-40 must round up to bf16 (once, from f64).
  const double values[] = {1.5, -0.25, 1.0 + std::ldexp(1.0, -8) + std::ldexp(1.0, -40), -9.0};
  for (DType dt : {DType::F32, DType::F64, DType::BF16, DType::I32})
    for (int64_t n : kSizes)
      for (int64_t offset : {0, 1})
        for (double value : values) {
          if (dt == DType::I32 && value != std::trunc(value)) continue;
          INFO(dtype_name(dt) << " n " << n << " offset " << offset << " value " << value);
          DeviceTensor d = poisoned(dt, {n}, offset);
          ops.fill(d.t, value);
          HostTensor want(dt, {n});
          cpu().fill(want, value);
          CHECK(bitwise_equal(download(d.t), want));
        }
  DeviceTensor i32(DType::I32, {3});
  CHECK_THROWS_AS(ops.fill(i32.t, 0.5), Error);
}

TEST_CASE("copy converts f32/f64/bf16 on the device like the reference", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const DType dtypes[] = {DType::F32, DType::F64, DType::BF16};
  for (int64_t n : {int64_t(16), int64_t(17), int64_t(4099), int64_t(1) << 20})
    for (DType src_dt : dtypes)
      for (DType dst_dt : dtypes) {
        if (src_dt == dst_dt) continue;
        // The source holds what a src_dt tensor can hold: the tricky doubles rounded to src_dt.
        const HostTensor src_host = as_dtype(tricky_values(n, 5), src_dt);
        HostTensor want(dst_dt, {n});
        cpu().copy(want, src_host);
        for (int64_t src_off : {0, 1})
          for (int64_t dst_off : {0, 1}) {
            INFO(dtype_name(src_dt) << " → " << dtype_name(dst_dt) << " n " << n << " offsets "
                                    << src_off << "," << dst_off);
            DeviceTensor src = upload_at(src_host, src_dt, src_off);
            DeviceTensor dst = poisoned(dst_dt, {n}, dst_off);
            ops.copy(dst.t, src.t);
            CHECK(bitwise_equal(download(dst.t), want));
          }
      }
  // A converting copy onto its own source cannot work element by element.
  DeviceTensor f(DType::F32, {8});
  Tensor as_bf16(f.t.data, DType::BF16, {8}, Device::CUDA);
  CHECK_THROWS_AS(ops.copy(as_bf16, f.t), Error);
}

TEST_CASE("add on the device rounds once and may run in place", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  for (DType dt : {DType::F32, DType::BF16, DType::F64})
    for (int64_t n : kSizes)
      for (int64_t offset : {0, 1}) {
        INFO(dtype_name(dt) << " n " << n << " offset " << offset);
        const HostTensor a = random_f32({n}, 1, -4, 4), b = random_f32({n}, 2, -4, 4);
        // The reference adds in fp32 (fp64 for f64) and the result is rounded once to dt: the
        // GPU's bf16 add is exactly that, so every dtype compares bitwise.
        const DType ref_dt = dt == DType::F64 ? DType::F64 : DType::F32;
        HostTensor ref(ref_dt, {n});
        cpu().add(ref, as_dtype(a, ref_dt), as_dtype(b, ref_dt));
        const HostTensor want = as_dtype(ref, dt);
        DeviceTensor da = upload_at(a, dt, offset), db = upload_at(b, dt, offset);
        DeviceTensor out = poisoned(dt, {n}, offset);
        ops.add(out.t, da.t, db.t);
        CHECK(bitwise_equal(download(out.t), want));
        ops.add(da.t, da.t, db.t);  // out aliases a
        CHECK(bitwise_equal(download(da.t), want));
        DeviceTensor da2 = upload_at(a, dt, offset);
        ops.add(db.t, da2.t, db.t);  // out aliases b
        CHECK(bitwise_equal(download(db.t), want));
      }
}

TEST_CASE("sum and sumsq on the device match an fp64 sum and are reproducible",
          "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  for (int64_t n :
       {int64_t(0), int64_t(1), int64_t(7), int64_t(1000), int64_t(4099), int64_t(10'000'000)}) {
    const HostTensor x = random_f32({n}, 9, -1, 1);
    for (DType dt : {DType::F32, DType::BF16, DType::F64})
      for (int64_t offset : {0, 1})
        for (bool square : {false, true})
          for (DType out_dt : {DType::F32, DType::F64}) {
            INFO(dtype_name(dt) << " n " << n << " offset " << offset
                                << (square ? " sumsq" : " sum") << " out " << dtype_name(out_dt));
            double want = 0, scale = 0;
            reference_reduce(x, square, want, scale);
            DeviceTensor dx = upload_at(x, dt, offset);
            DeviceTensor out = poisoned(out_dt, {1});
            auto run = [&] {
              if (square)
                ops.sumsq(out.t, dx.t);
              else
                ops.sum(out.t, dx.t);
              return download(out.t);
            };
            const HostTensor got = run();
            CHECK(std::fabs(got.get(0) - want) <= kReduceRtol * scale);
            CHECK(bitwise_equal(run(), got));
          }
  }
}

TEST_CASE("swiglu forward and backward on the device match the reference", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const int64_t shapes[][3] = {{1, 1, 0},    {3, 5, 0},    {7, 13, 0}, {5, 8, 0},
                               {64, 768, 0}, {257, 24, 0}, {9, 16, 1}, {2, 1000, 0}};
  for (auto& s : shapes) {
    const int64_t rows = s[0], width = s[1], offset = s[2];
    INFO("rows " << rows << " width " << width << " offset " << offset);
    const HostTensor gu = random_f32({rows, 2 * width}, 11, -4, 4);
    const HostTensor dh = random_f32({rows, width}, 12, -1, 1);
    HostTensor h_ref(DType::F32, {rows, width}), dgu_ref(DType::F32, {rows, 2 * width});
    cpu().swiglu_fwd(h_ref, gu);
    cpu().swiglu_bwd(dgu_ref, dh, gu);
    DeviceTensor dgu_in = upload_at(gu, DType::BF16, offset);
    DeviceTensor h = poisoned(DType::BF16, {rows, width}, offset);
    ops.swiglu_fwd(h.t, dgu_in.t);
    {
      std::string first;
      const int64_t bad = mismatches(download(h.t), h_ref, 1e-6, kSwigluRtol, &first);
      INFO("h: " << first);
      CHECK(bad == 0);
    }
    DeviceTensor ddh = upload_at(dh, DType::BF16, offset);
    DeviceTensor dgu = poisoned(DType::BF16, {rows, 2 * width}, offset);
    ops.swiglu_bwd(dgu.t, ddh.t, dgu_in.t);
    const HostTensor got = download(dgu.t);
    {
      std::string first;
      const int64_t bad = mismatches(got, dgu_ref, kSwigluAtol, kSwigluRtol, &first);
      INFO("dgu: " << first);
      CHECK(bad == 0);
    }
    ops.swiglu_bwd(dgu_in.t, ddh.t, dgu_in.t);  // in place over gu
    CHECK(bitwise_equal(download(dgu_in.t), got));
  }
}

#endif  // MOP_HAVE_CUDA
