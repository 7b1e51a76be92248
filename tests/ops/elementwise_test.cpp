// elementwise: fill, copy with dtype conversion (bf16 rounding to nearest-even, including from
// f64 near ties), add with aliasing, sum over every float dtype on the CPU reference, and the exact
// sum of squares (its documented blocks, exactness, split and thread invariance, flags); the CUDA
// backend ([gpu]) bitwise where both sides round the same exact value once (sumsq: always),
// named tolerances elsewhere, over sizes 1, primes, non-multiples of every vector width and 10^7.

#include <omp.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/exact_sum.h"
#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

namespace {

bf16 bf16_from_bits(uint16_t bits) {
  return bf16{bits};
}

// Independent nearest-even rounding of a double to bf16: of the two bf16 neighbours around d,
// the closer one; on an exact tie the one with an even last bit. (Finite, normal range.)
uint16_t reference_bf16_bits(double d) {
  const float f = float(d);  // within one float ulp of d: its bf16 neighbours bracket d
  uint32_t u;
  std::memcpy(&u, &f, 4);
  const uint16_t low = uint16_t(u >> 16);  // truncation toward zero in magnitude
  const uint16_t cand[3] = {uint16_t(low - 1), low, uint16_t(low + 1)};
  uint16_t best = low;
  double best_err = INFINITY;
  for (uint16_t c : cand) {
    const double err = std::fabs(double(bf16_to_float(bf16_from_bits(c))) - d);
    if (err < best_err || (err == best_err && (c & 1) == 0)) best = c, best_err = err;
  }
  return best;
}

}  // namespace

TEST_CASE("fill writes every supported dtype and rejects the rest", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor f(DType::F32, {5}), d(DType::F64, {2, 3}), b(DType::BF16, {7}), i(DType::I32, {3});
  ops.fill(f, 1.5);
  ops.fill(d, -0.25);
  ops.fill(b, 3.0);
  ops.fill(i, -9);
  for (int64_t k = 0; k < 5; ++k) CHECK(f.get(k) == 1.5);
  for (int64_t k = 0; k < 6; ++k) CHECK(d.get(k) == -0.25);
  for (int64_t k = 0; k < 7; ++k) CHECK(b.get(k) == 3.0);
  for (int64_t k = 0; k < 3; ++k) CHECK(i.ptr<int32_t>()[k] == -9);
  CHECK_THROWS_AS(ops.fill(i, 0.5), Error);
  HostTensor u8(DType::U8, {4});
  CHECK_THROWS_AS(ops.fill(u8, 1), Error);
}

TEST_CASE("copy converts between f32, f64 and bf16 with nearest-even rounding", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const double ulp7 = std::ldexp(1.0, -7);
  // f32 → bf16: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 and goes to the even one (1).
  HostTensor f(DType::F32, {4}), b(DType::BF16, {4});
  const float fv[] = {1.0f + 1.0f / 256, 1.0f + 3.0f / 256, -1.0f - 1.0f / 256, 1e-3f};
  for (int k = 0; k < 4; ++k) f.set(k, fv[k]);
  ops.copy(b, f);
  CHECK(b.get(0) == 1.0);
  CHECK(b.get(1) == 1.0 + 2 * ulp7);
  CHECK(b.get(2) == -1.0);
  CHECK(b.ptr<bf16>()[3].bits == float_to_bf16(1e-3f).bits);

  // f64 → bf16 rounds once: just above the tie must round up, although float(d) is the tie.
  HostTensor d(DType::F64, {5}), b2(DType::BF16, {5});
  const double dv[] = {1 + ulp7 / 2 + std::ldexp(1.0, -40), -(1 + ulp7 / 2 + std::ldexp(1.0, -40)),
                       1 + ulp7 / 2, 1e39, std::nan("")};
  for (int k = 0; k < 5; ++k) d.set(k, dv[k]);
  ops.copy(b2, d);
  CHECK(b2.get(0) == 1 + ulp7);
  CHECK(b2.get(1) == -(1 + ulp7));
  CHECK(b2.get(2) == 1.0);
  CHECK(std::isinf(b2.get(3)));
  CHECK(std::isnan(b2.get(4)));

  // Many doubles at and around bf16 ties against an independent nearest-even rounding.
  const int64_t n = 3000;
  HostTensor near(DType::F64, {n}), nb(DType::BF16, {n});
  for (int64_t k = 0; k < n; ++k) {
    const uint16_t bits = uint16_t(0x3000 + philox_u64(1, 2, k) % 0x1800);  // ≈ 2^-31 … 2^17
    const double lo = bf16_to_float(bf16_from_bits(bits)),
                 hi = bf16_to_float(bf16_from_bits(bits + 1));
    // Offsets below half a float ulp ((hi − lo)·2^-17): float(d) is the tie itself.
    const double offset = double(k % 3 - 1) * (hi - lo) * std::ldexp(1.0, -20);
    near.set(k, (lo + hi) / 2 + offset);
  }
  ops.copy(nb, near);
  int64_t bad = 0;
  for (int64_t k = 0; k < n; ++k) bad += nb.ptr<bf16>()[k].bits != reference_bf16_bits(near.get(k));
  CHECK(bad == 0);

  // Widening is exact; f64 → f32 rounds; same-dtype copies are bytewise (i32 included).
  HostTensor back(DType::F64, {5}), f2(DType::F32, {5});
  ops.copy(back, b2);
  CHECK(back.get(0) == 1 + ulp7);
  ops.copy(f2, d);
  CHECK(f2.get(0) == double(float(dv[0])));
  HostTensor i1(DType::I32, {2, 3}), i2(DType::I32, {6});
  for (int k = 0; k < 6; ++k) i1.ptr<int32_t>()[k] = k * 1000003 - 7;
  ops.copy(i2, i1);
  CHECK(bitwise_equal(i1, i2));
  HostTensor f6(DType::F32, {6}), f7(DType::F32, {7});
  CHECK_THROWS_AS(ops.copy(f6, i1), Error);
  CHECK_THROWS_AS(ops.copy(f7, f6), Error);
}

TEST_CASE("add allows out to alias an input", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  for (DType dt : {DType::F32, DType::F64}) {
    HostTensor a = bf16_exact_tensor(dt, {3, 5}, 1), b = bf16_exact_tensor(dt, {3, 5}, 2);
    HostTensor out(dt, {3, 5}), a0 = a;
    ops.add(out, a, b);
    ops.add(a, a, b);
    for (int64_t i = 0; i < 15; ++i) CHECK(out.get(i) == a0.get(i) + b.get(i));  // exact: bf16
    CHECK(bitwise_equal(out, a));
  }
  HostTensor a(DType::F32, {3}), b(DType::F32, {4}), c(DType::F64, {3});
  CHECK_THROWS_AS(ops.add(a, a, b), Error);
  CHECK_THROWS_AS(ops.add(a, a, c), Error);
}

TEST_CASE("sum accumulates any float dtype in double", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  for (DType in : {DType::F32, DType::F64, DType::BF16})
    for (DType out_dt : {DType::F32, DType::F64}) {
      HostTensor x = random_tensor(in, {7, 13}, 3);
      double s = 0;
      for (int64_t i = 0; i < x.numel(); ++i) s += x.get(i);
      HostTensor o1(out_dt, {1});
      ops.sum(o1, x);
      INFO(dtype_name(in) << " → " << dtype_name(out_dt));
      // Same terms, same order, in double; then one rounding to the output dtype.
      CHECK(o1.get(0) == (out_dt == DType::F32 ? double(float(s)) : s));
    }
  HostTensor x(DType::F32, {4}), two(DType::F32, {2});
  CHECK_THROWS_AS(ops.sum(two, x), Error);
}

namespace {
ExactSum exact_of(const HostTensor& out) {
  ExactSum s;
  for (int i = 0; i < 3; ++i) s.words[i] = uint64_t(out.ptr<int64_t>()[i]);
  s.bad = uint64_t(out.ptr<int64_t>()[3]);
  return s;
}
ExactSum sumsq_of(Ops& ops, const Tensor& x) {
  HostTensor out(DType::I64, {4});
  ops.sumsq(out, x);
  return exact_of(out);
}
bool same(const ExactSum& a, const ExactSum& b) {
  return a.words[0] == b.words[0] && a.words[1] == b.words[1] && a.words[2] == b.words[2] &&
         a.bad == b.bad;
}
}  // namespace

TEST_CASE("sumsq is exact on exactly representable sums", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  // x_i = k_i / 8 with small integers k_i: every square and block sum is exact in fp64, so the op
  // returns Σ k² / 64 exactly: Σ k² · 2^58 units of 2^-64.
  for (DType dt : {DType::F32, DType::F64, DType::BF16})
    for (int64_t n : {int64_t(1), int64_t(63), int64_t(64), int64_t(65), int64_t(1031)}) {
      HostTensor x(dt, {n});
      unsigned __int128 want = 0;
      for (int64_t i = 0; i < n; ++i) {
        const int k = int((i * 37 + 11) % 201) - 100;
        x.set(i, k / 8.0);
        want += (unsigned __int128)(k * k) << 58;
      }
      INFO(dtype_name(dt) << " n " << n);
      const ExactSum got = sumsq_of(ops, x);
      CHECK(got.bad == 0);
      CHECK(got.words[2] == 0);
      CHECK(got.words[0] == uint64_t(want));
      CHECK(got.words[1] == uint64_t(want >> 64));
      CHECK(want != 0);
    }
}

TEST_CASE("sumsq of a tensor is the exact sum of its 64-aligned pieces', on any threads",
          "[cpu][ops]") {
  Ops& ops = cpu_ops();
  for (DType dt : {DType::F32, DType::F64, DType::BF16}) {
    const int64_t n = 4099;
    const HostTensor x = random_tensor(dt, {n}, 17);
    const ExactSum whole = sumsq_of(ops, x);
    double plain = 0;
    for (int64_t i = 0; i < n; ++i) plain += x.get(i) * x.get(i);
    INFO(dtype_name(dt));
    CHECK(whole.bad == 0);
    CHECK(std::fabs(whole.value() - plain) <= 1e-12 * plain);
    // Cut at multiples of 64 (as slices of any count are): the pieces' sums add up to the whole's.
    for (int64_t piece : {int64_t(64), int64_t(640), int64_t(1024), int64_t(2048 + 64)}) {
      ExactSum sum;
      for (int64_t first = 0; first < n; first += piece) {
        Tensor part = x.t;
        part.data = static_cast<char*>(x.t.data) + first * int64_t(dtype_size(dt));
        part.shape[0] = std::min(piece, n - first);
        sum.add(sumsq_of(ops, part));
      }
      INFO("pieces of " << piece);
      CHECK(same(sum, whole));
    }
    // A piece that starts elsewhere regroups the squares: its sum may differ in the last bits.
    for (int threads : {1, 2}) {
      omp_set_num_threads(threads);
      CHECK(same(sumsq_of(ops, x), whole));
    }
  }
}

TEST_CASE("sumsq's blocks follow the documented tree", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const HostTensor x = random_tensor(DType::F64, {64}, 5, -1e3, 1e3);
  double g[16];
  for (int j = 0; j < 16; ++j) {
    const double* v = x.ptr<double>() + 4 * j;
    g[j] = (v[0] * v[0] + v[1] * v[1]) + (v[2] * v[2] + v[3] * v[3]);
  }
  for (int off : {8, 4, 2, 1})
    for (int j = 0; j < off; ++j) g[j] += g[j + off];
  ExactSum want;
  want.add_double(g[0]);
  CHECK(same(sumsq_of(ops, x), want));
}

TEST_CASE("sumsq flags non-finite terms and sums past 2^128; tiny terms vanish", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor x(DType::F32, {200});
  for (int64_t i = 0; i < 200; ++i) x.set(i, 0.5);
  CHECK(sumsq_of(ops, x).bad == 0);
  CHECK(sumsq_of(ops, x).value() == 50.0);
  for (double bad : {double(INFINITY), double(NAN), std::ldexp(1.0, 65)}) {
    HostTensor y = x;
    y.set(130, bad);
    INFO(bad);
    CHECK(sumsq_of(ops, y).bad == 1);
  }
  HostTensor tiny(DType::F32, {3});
  for (int64_t i = 0; i < 3; ++i) tiny.set(i, std::ldexp(1.0, -40));  // squares below 2^-64
  CHECK(sumsq_of(ops, tiny).value() == 0.0);
  HostTensor f32(DType::F32, {1}), i64(DType::I64, {3});
  CHECK_THROWS_AS(ops.sumsq(f32, x), Error);
  CHECK_THROWS_AS(ops.sumsq(i64, x), Error);
}

TEST_CASE("exact sums: carries, and the pieces a sum over ranks adds", "[cpu][ops]") {
  ExactSum a;
  a.add_words(~uint64_t(0), ~uint64_t(0), 0);
  a.add_words(1, 0, 0);  // carries through the middle word
  CHECK((a.words[0] == 0 && a.words[1] == 0 && a.words[2] == 1 && a.bad == 0));
  a.add_words(0, 0, ~uint64_t(0));  // past the top
  CHECK(a.bad == 1);
  // Three ranks' sums, added as pieces in doubles (as all_reduce_host does), in two orders.
  ExactSum r[3];
  const double terms[3] = {std::ldexp(1.0, 100) + 3.0, 12345.6789, std::ldexp(1.0, -50)};
  ExactSum direct;
  for (int i = 0; i < 3; ++i) {
    r[i].add_double(terms[i]);
    r[i].add_double(terms[(i + 1) % 3]);
    direct.add(r[i]);
  }
  double sum[ExactSum::kPieces] = {}, back[ExactSum::kPieces] = {};
  for (int i = 0; i < 3; ++i) {
    double p[ExactSum::kPieces], q[ExactSum::kPieces];
    r[i].to_pieces(p);
    r[2 - i].to_pieces(q);
    for (int k = 0; k < ExactSum::kPieces; ++k) sum[k] += p[k], back[k] += q[k];
  }
  CHECK(same(ExactSum::from_pieces(sum), direct));
  CHECK(same(ExactSum::from_pieces(back), direct));
  CHECK(direct.value() == std::ldexp(1.0, 101));  // the small terms are below its ulp
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

namespace cuda {
using namespace mop;
using namespace mop::test;
using namespace mop::test::pw;

namespace {

const int64_t kSizes[] = {1, 7, 13, 4099, 1000003};

// sum/sumsq: the GPU pairs bf16 terms in fp32 (one rounding, 2^-24 of the pair's magnitude) and
// otherwise adds in fp64; the reference adds in fp64. Both round the total once to f32 (2^-24).
// So they differ by at most ~3·2^-24 ≈ 1.8e-7 of Σ|term|; 4e-7 leaves a margin.
constexpr double kReduceRtol = 4e-7;

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

TEST_CASE("sum on the device matches an fp64 sum and is reproducible", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  for (int64_t n :
       {int64_t(0), int64_t(1), int64_t(7), int64_t(1000), int64_t(4099), int64_t(10'000'000)}) {
    const HostTensor x = random_f32({n}, 9, -1, 1);
    for (DType dt : {DType::F32, DType::BF16, DType::F64})
      for (int64_t offset : {0, 1})
        for (DType out_dt : {DType::F32, DType::F64}) {
          INFO(dtype_name(dt) << " n " << n << " offset " << offset << " out "
                              << dtype_name(out_dt));
          double want = 0, scale = 0;
          reference_reduce(x, false, want, scale);
          DeviceTensor dx = upload_at(x, dt, offset);
          DeviceTensor out = poisoned(out_dt, {1});
          auto run = [&] {
            ops.sum(out.t, dx.t);
            return download(out.t);
          };
          const HostTensor got = run();
          CHECK(std::fabs(got.get(0) - want) <= kReduceRtol * scale);
          CHECK(bitwise_equal(run(), got));
        }
  }
}

// The exact sum of squares is integer arithmetic after each block's fixed tree: the device's words
// equal the reference's, bit for bit, for any size, dtype and alignment (the vector and scalar
// loads), and non-finite terms set the flag on both.
TEST_CASE("sumsq on the device equals the CPU reference exactly", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  Ops& ref = cpu_ops();
  for (int64_t n : {int64_t(0), int64_t(1), int64_t(7), int64_t(63), int64_t(64), int64_t(65),
                    int64_t(129), int64_t(4099), int64_t(1'000'003), int64_t(10'000'000)}) {
    HostTensor x = random_f32({n}, 11, -3, 3);
    for (bool nonfinite : {false, true}) {
      if (nonfinite && n < 65) continue;
      if (nonfinite) x.set(64, double(NAN));
      for (DType dt : {DType::F32, DType::BF16, DType::F64})
        for (int64_t offset : {0, 1}) {
          INFO(dtype_name(dt) << " n " << n << " offset " << offset
                              << (nonfinite ? " with a NaN" : ""));
          const HostTensor xd = as_dtype(x, dt);
          HostTensor want(DType::I64, {4});
          ref.sumsq(want, xd);
          DeviceTensor dx = upload_at(x, dt, offset);
          DeviceTensor out = poisoned(DType::I64, {4});
          ops.sumsq(out.t, dx.t);
          const HostTensor got = download(out.t);
          CHECK(bitwise_equal(got, want));
          CHECK(want.ptr<int64_t>()[3] == (nonfinite ? 1 : 0));
        }
    }
  }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
