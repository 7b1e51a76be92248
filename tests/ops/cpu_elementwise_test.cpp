// CPU reference elementwise and memory ops: fill, copy with dtype conversion (bf16 rounding to
// nearest-even, including from f64 near ties), add with aliasing, sum/sumsq over every float
// dtype, embedding forward/backward and SwiGLU forward/backward (finite differences).
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

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

TEST_CASE("sum and sumsq accumulate any float dtype in double", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  for (DType in : {DType::F32, DType::F64, DType::BF16})
    for (DType out_dt : {DType::F32, DType::F64}) {
      HostTensor x = random_tensor(in, {7, 13}, 3);
      double s = 0, s2 = 0;
      for (int64_t i = 0; i < x.numel(); ++i) s += x.get(i), s2 += x.get(i) * x.get(i);
      HostTensor o1(out_dt, {1}), o2(out_dt, {1});
      ops.sum(o1, x);
      ops.sumsq(o2, x);
      INFO(dtype_name(in) << " → " << dtype_name(out_dt));
      CHECK(s2 > 1);
      // Same terms, same order, in double; then one rounding to the output dtype.
      CHECK(o1.get(0) == (out_dt == DType::F32 ? double(float(s)) : s));
      CHECK(o2.get(0) == (out_dt == DType::F32 ? double(float(s2)) : s2));
    }
  HostTensor x(DType::F32, {4}), two(DType::F32, {2}), i(DType::I32, {1});
  CHECK_THROWS_AS(ops.sum(two, x), Error);
  CHECK_THROWS_AS(ops.sumsq(i, x), Error);
}

TEST_CASE("embedding gathers rows; backward adds repeated ids (finite differences)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t vocab = 11, hidden = 5, tokens = 7;
  HostTensor ids(DType::I32, {tokens});
  const int32_t id[] = {3, 0, 10, 3, 7, 3, 0};  // repeats, first and last row
  for (int64_t t = 0; t < tokens; ++t) ids.ptr<int32_t>()[t] = id[t];
  HostTensor table = random_tensor(DType::F64, {vocab, hidden}, 4);
  HostTensor out(DType::F64, {tokens, hidden});
  ops.embedding_fwd(out, ids, table);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h)
      CHECK(out.get(t * hidden + h) == table.get(id[t] * hidden + h));

  HostTensor weights = random_tensor(DType::F64, {tokens, hidden}, 5);
  auto loss = [&] {
    ops.embedding_fwd(out, ids, table);
    return weighted_sum(weights, out);
  };
  HostTensor d0 = random_tensor(DType::F64, {vocab, hidden}, 6), dtable = d0;
  ops.embedding_bwd(dtable, ids, weights);
  for (int64_t i = 0; i < dtable.numel(); ++i) dtable.set(i, dtable.get(i) - d0.get(i));
  check_grad("embedding table", table, dtable, loss);

  ids.ptr<int32_t>()[2] = int32_t(vocab);
  CHECK_THROWS_AS(ops.embedding_fwd(out, ids, table), Error);
  CHECK_THROWS_AS(ops.embedding_bwd(dtable, ids, weights), Error);
}

TEST_CASE("swiglu forward is silu(g)·u; backward matches finite differences", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t rows = 7, width = 13;
  HostTensor gu = random_tensor(DType::F64, {rows, 2 * width}, 7, -4, 4);
  HostTensor h(DType::F64, {rows, width});
  ops.swiglu_fwd(h, gu);
  double worst = 0;
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < width; ++c) {
      const double g = gu.get(r * 2 * width + c), u = gu.get(r * 2 * width + width + c);
      worst = std::max(worst, std::fabs(h.get(r * width + c) - g / (1 + std::exp(-g)) * u));
    }
  CHECK(worst < kFp64Tol);

  HostTensor weights = random_tensor(DType::F64, {rows, width}, 8);
  auto loss = [&] {
    ops.swiglu_fwd(h, gu);
    return weighted_sum(weights, h);
  };
  HostTensor dgu(DType::F64, {rows, 2 * width});
  ops.fill(dgu, std::nan(""));
  ops.swiglu_bwd(dgu, weights, gu);
  check_grad("swiglu gu", gu, dgu, loss);

  // f32 agrees with f64.
  HostTensor gu64 = bf16_exact_tensor(DType::F64, {rows, 2 * width}, 9, -4, 4);
  HostTensor h32(DType::F32, {rows, width}), d32(DType::F32, {rows, 2 * width});
  HostTensor d64(DType::F64, {rows, 2 * width});
  ops.swiglu_fwd(h, gu64);
  ops.swiglu_fwd(h32, converted(gu64, DType::F32));
  ops.swiglu_bwd(d64, weights, gu64);
  ops.swiglu_bwd(d32, converted(weights, DType::F32), converted(gu64, DType::F32));
  CHECK(max_abs_diff(h32, h) < kF32VsF64Tol);
  CHECK(max_abs_diff(d32, d64) < kF32VsF64Tol);
  HostTensor odd(DType::F64, {rows, 2 * width + 1});
  CHECK_THROWS_AS(ops.swiglu_fwd(h, odd), Error);
}
