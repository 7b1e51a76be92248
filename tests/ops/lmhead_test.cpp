// lmhead: the fused LM head + cross-entropy — the CPU reference against full logits computed
// naively, chunks that do not divide T, masked targets, finite differences of dx and dw,
// chunk-size and thread-count independence; the CUDA backend against the reference ([gpu]),
// and the training form giving the bits of forward then backward.

#include <cmath>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

struct LmCase {
  int64_t tokens, hidden, vocab;
};

HostTensor make_targets(int64_t tokens, int64_t vocab, uint64_t seed) {
  HostTensor t(DType::I32, {tokens});
  for (int64_t i = 0; i < tokens; ++i)
    t.ptr<int32_t>()[i] = int32_t(philox_u64(seed, 1, i) % vocab);
  t.ptr<int32_t>()[1 % tokens] = -1;           // masked (padding)
  if (tokens > 4) t.ptr<int32_t>()[4] = -100;  // masked (Hugging Face's ignore index)
  return t;
}

}  // namespace

TEST_CASE("lmhead_ce forward equals cross-entropy of the full logits", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const LmCase c{7, 5, 11};
  HostTensor x = random_tensor(DType::F64, {c.tokens, c.hidden}, 1, -2, 2);
  HostTensor w = random_tensor(DType::F64, {c.vocab, c.hidden}, 2, -2, 2);
  HostTensor targets = make_targets(c.tokens, c.vocab, 3);
  std::vector<double> ref_loss(static_cast<size_t>(c.tokens)), ref_lse(ref_loss);
  for (int64_t t = 0; t < c.tokens; ++t) {
    std::vector<double> z(static_cast<size_t>(c.vocab));
    double m = -INFINITY, s = 0;
    for (int64_t v = 0; v < c.vocab; ++v) {
      for (int64_t h = 0; h < c.hidden; ++h)
        z[size_t(v)] += x.get(t * c.hidden + h) * w.get(v * c.hidden + h);
      m = std::max(m, z[size_t(v)]);
    }
    for (double zv : z) s += std::exp(zv - m);
    ref_lse[size_t(t)] = m + std::log(s);
    const int32_t tg = targets.ptr<int32_t>()[t];
    ref_loss[size_t(t)] = tg < 0 ? 0.0 : ref_lse[size_t(t)] - z[size_t(tg)];
  }
  HostTensor first_loss;
  for (int64_t chunk : {1, 3, 7, 10}) {
    INFO("chunk " << chunk);
    HostTensor loss(DType::F64, {c.tokens}), lse(DType::F64, {c.tokens});
    HostTensor ws(DType::F64, {chunk, c.vocab});
    ops.fill(loss, std::nan(""));
    ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws);
    for (int64_t t = 0; t < c.tokens; ++t) {
      CHECK(std::fabs(loss.get(t) - ref_loss[size_t(t)]) < kFp64Tol);
      CHECK(std::fabs(lse.get(t) - ref_lse[size_t(t)]) < kFp64Tol);
    }
    CHECK(loss.get(1) == 0.0);
    CHECK(loss.get(4) == 0.0);
    if (chunk == 1) first_loss = loss;
    CHECK(bitwise_equal(loss, first_loss));  // per-row arithmetic does not depend on chunking
  }
}

TEST_CASE("lmhead_ce backward matches finite differences (fp64)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const LmCase cases[] = {{7, 5, 11}, {1, 3, 2}, {6, 8, 13}};
  for (const LmCase& c : cases) {
    const int64_t chunk = 3;
    INFO("T " << c.tokens << " H " << c.hidden << " V " << c.vocab);
    HostTensor x = random_tensor(DType::F64, {c.tokens, c.hidden}, 4);
    HostTensor w = random_tensor(DType::F64, {c.vocab, c.hidden}, 5);
    HostTensor targets = make_targets(c.tokens, c.vocab, 6);
    if (c.tokens == 1) targets.ptr<int32_t>()[0] = 1;  // keep the single token unmasked
    HostTensor ws(DType::F64, {chunk, c.vocab});
    HostTensor loss(DType::F64, {c.tokens}), lse(DType::F64, {c.tokens});
    const float grad_scale = 0.7f;
    auto objective = [&] {
      ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws);
      double s = 0;
      for (int64_t t = 0; t < c.tokens; ++t) s += loss.get(t);
      return double(grad_scale) * s;
    };
    objective();
    HostTensor dx(DType::F64, {c.tokens, c.hidden});
    HostTensor dw0 = random_tensor(DType::F64, {c.vocab, c.hidden}, 7), dw = dw0;
    ops.fill(dx, std::nan(""));  // overwritten
    ops.fill(ws, std::nan(""));  // scratch only
    ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, grad_scale, ws);
    for (int64_t i = 0; i < dw.numel(); ++i) dw.set(i, dw.get(i) - dw0.get(i));  // dw +=
    check_grad("lmhead x", x, dx, objective);
    check_grad("lmhead w", w, dw, objective);
    for (int64_t t = 0; t < c.tokens; ++t)
      if (targets.ptr<int32_t>()[t] < 0)
        for (int64_t h = 0; h < c.hidden; ++h) CHECK(dx.get(t * c.hidden + h) == 0.0);
  }
}

TEST_CASE("lmhead_ce backward: chunking keeps dx bitwise, threads keep everything bitwise",
          "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const LmCase c{29, 24, 37};
  for (DType dt : {DType::F32, DType::F64}) {
    HostTensor x = random_tensor(dt, {c.tokens, c.hidden}, 8);
    HostTensor w = random_tensor(dt, {c.vocab, c.hidden}, 9);
    HostTensor targets = make_targets(c.tokens, c.vocab, 10);
    HostTensor loss(dt, {c.tokens}), lse(dt, {c.tokens});
    HostTensor ws_full(dt, {c.tokens, c.vocab}), ws_small(dt, {4, c.vocab});
    ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws_full);
    HostTensor dx_full(dt, {c.tokens, c.hidden}), dw_full(dt, {c.vocab, c.hidden});
    HostTensor dx_small = dx_full, dw_small = dw_full, dx_1t = dx_full, dw_1t = dw_full;
    ops.lmhead_ce_bwd(dx_full, dw_full, x, w, targets, lse, 1.0f, ws_full);
    with_threads(
        2, [&] { ops.lmhead_ce_bwd(dx_small, dw_small, x, w, targets, lse, 1.0f, ws_small); });
    with_threads(1, [&] { ops.lmhead_ce_bwd(dx_1t, dw_1t, x, w, targets, lse, 1.0f, ws_small); });
    INFO(dtype_name(dt));
    CHECK(max_abs(dx_full) > 0);
    CHECK(bitwise_equal(dx_full, dx_small));
    CHECK(bitwise_equal(dx_small, dx_1t));
    CHECK(bitwise_equal(dw_small, dw_1t));
    // dw sums chunk by chunk: regrouping changes only rounding.
    CHECK(max_abs_diff(dw_full, dw_small) < (dt == DType::F64 ? kFp64Tol : kF32VsF64Tol));
  }
}

TEST_CASE("lmhead_ce in f32 agrees with f64", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const LmCase c{10, 16, 50};
  HostTensor x64 = bf16_exact_tensor(DType::F64, {c.tokens, c.hidden}, 11);
  HostTensor w64 = bf16_exact_tensor(DType::F64, {c.vocab, c.hidden}, 12);
  HostTensor targets = make_targets(c.tokens, c.vocab, 13);
  HostTensor res[2][4];  // [f32, f64][loss, lse, dx, dw]
  for (int p = 0; p < 2; ++p) {
    const DType dt = p == 0 ? DType::F32 : DType::F64;
    HostTensor x = converted(x64, dt), w = converted(w64, dt), ws(dt, {3, c.vocab});
    HostTensor loss(dt, {c.tokens}), lse(dt, {c.tokens});
    HostTensor dx(dt, {c.tokens, c.hidden}), dw(dt, {c.vocab, c.hidden});
    ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws);
    ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, 0.5f, ws);
    res[p][0] = loss, res[p][1] = lse, res[p][2] = dx, res[p][3] = dw;
  }
  for (int i = 0; i < 4; ++i) {
    INFO("output " << i);
    CHECK(max_abs(res[1][i]) > 0);
    CHECK(max_abs_diff(res[0][i], res[1][i]) < kF32VsF64Tol);
  }
}

TEST_CASE("lmhead_ce rejects bad targets, shapes and dtypes", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor x(DType::F32, {4, 3}), w(DType::F32, {6, 3}), ws(DType::F32, {2, 6});
  HostTensor loss(DType::F32, {4}), lse(DType::F32, {4}), targets(DType::I32, {4});
  CHECK_NOTHROW(ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws));
  targets.ptr<int32_t>()[2] = 6;
  CHECK_THROWS_AS(ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws), Error);
  targets.ptr<int32_t>()[2] = 0;
  HostTensor ws_bad(DType::F32, {2, 5}), ws_empty(DType::F32, {0, 6}), lse64(DType::F64, {4});
  CHECK_THROWS_AS(ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws_bad), Error);
  CHECK_THROWS_AS(ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws_empty), Error);
  CHECK_THROWS_AS(ops.lmhead_ce_fwd(loss, lse64, x, w, targets, ws), Error);
}

TEST_CASE("lmhead_ce_fwd_bwd equals forward then backward, bit for bit", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const LmCase c{29, 24, 37};
  for (DType dt : {DType::F32, DType::F64}) {
    for (int64_t chunk : {1, 4, 29, 40}) {
      INFO(dtype_name(dt) << ", chunk " << chunk);
      HostTensor x = random_tensor(dt, {c.tokens, c.hidden}, 14);
      HostTensor w = random_tensor(dt, {c.vocab, c.hidden}, 15);
      HostTensor targets = make_targets(c.tokens, c.vocab, 16);
      HostTensor ws(dt, {chunk, c.vocab});
      HostTensor loss(dt, {c.tokens}), lse(dt, {c.tokens}), dx(dt, {c.tokens, c.hidden});
      HostTensor dw = random_tensor(dt, {c.vocab, c.hidden}, 17);  // dw +=: a running sum
      HostTensor loss2 = loss, lse2 = lse, dx2 = dx, dw2 = dw;
      ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws);
      ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, 0.37f, ws);
      ops.fill(dx2, std::nan(""));  // overwritten
      ops.lmhead_ce_fwd_bwd(loss2, lse2, dx2, dw2, x, w, targets, 0.37f, ws);
      CHECK(max_abs(dx) > 0);
      CHECK(bitwise_equal(loss, loss2));
      CHECK(bitwise_equal(lse, lse2));
      CHECK(bitwise_equal(dx, dx2));
      CHECK(bitwise_equal(dw, dw2));
    }
  }
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include "gpu/gpu_test_util.h"

namespace cuda {
using namespace mop;
using namespace mop::test;

namespace {

constexpr double kUlp = 1.0 / (1 << 24);  // fp32 unit roundoff (half an ulp at 1)
// lse = m + log Σ_v exp(z_v − m): the CPU sums V positive terms in sequence (relative error
// ≤ (V−1)·u), the GPU in a tree with online rescaling (a few u), each exp is within 2 ulp and the
// final m + log rounds by u·|lse|. Hence |Δlse| ≤ (V + 256)·u for |lse| < 64; loss = lse − z with z
// exact adds one rounding, covered by the same bound.
double lse_atol(int64_t vocab) {
  return double(vocab + 256) * kUlp;
}
// dlogits are rounded to bf16 on the GPU (≤ 2^-9 relative) and kept fp32 by the reference, and p
// depends on lse (|Δ| ≲ 1e-4 relative); 2^-8 of Σ|dlogits|·|operand| bounds the effect on dx and
// dw.
constexpr double kDlogitsRel = 1.0 / 256;
// dx is bf16: one more rounding, ≤ one bf16 ulp (2^-7 relative at the bottom of a binade).
constexpr double kBf16Ulp = 1.0 / 128;

struct LmCase {
  int64_t tokens, hidden, vocab, chunk;
};

// Multiples of 1/16 in [−1/4, 1/4].
HostTensor dyadic_tensor(std::initializer_list<int64_t> dims, uint64_t seed) {
  HostTensor t(DType::F32, dims);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set(i, double(int(philox_u64(seed, 9, uint64_t(i)) % 9) - 4) / 16);
  REQUIRE(max_abs(t) > 0);
  return t;
}

// Random targets with padding (−1), Hugging Face's ignore index (−100) and every 7th token masked.
HostTensor make_targets(int64_t tokens, int64_t vocab, uint64_t seed) {
  HostTensor t(DType::I32, {tokens});
  for (int64_t i = 0; i < tokens; ++i)
    t.ptr<int32_t>()[i] =
        i % 7 == 6 ? -1 : int32_t(philox_u64(seed, 1, uint64_t(i)) % uint64_t(vocab));
  if (tokens > 1) t.ptr<int32_t>()[1] = -1;
  if (tokens > 4) t.ptr<int32_t>()[4] = -100;
  return t;
}

// Σ_v |dlogits[t,v]|·|w[v,h]| and Σ_t |dlogits[t,v]|·|x[t,h]|: the scale of each dx and dw
// element's error when dlogits are rounded; dlogits from exact logits and the reference lse.
void dlogits_bounds(HostTensor& bound_dx, HostTensor& bound_dw, const HostTensor& x,
                    const HostTensor& w, const HostTensor& targets, const HostTensor& lse,
                    float grad_scale, const LmCase& c) {
  HostTensor abs_dl(DType::F32, {c.tokens, c.vocab}), abs_x = x, abs_w = w;
  for (int64_t t = 0; t < c.tokens; ++t) {
    const int32_t target = targets.ptr<int32_t>()[t];
    for (int64_t v = 0; v < c.vocab; ++v) {
      double z = 0;
      for (int64_t h = 0; h < c.hidden; ++h) z += x.get(t * c.hidden + h) * w.get(v * c.hidden + h);
      const double p = std::exp(z - lse.get(t));
      // + p/16: at the target |p − 1| may be far below p, whose own error (from lse) still counts.
      abs_dl.set(t * c.vocab + v,
                 target < 0 ? 0.0 : (std::fabs(v == target ? p - 1 : p) + p / 16) * grad_scale);
    }
  }
  for (HostTensor* m : {&abs_x, &abs_w})
    for (int64_t i = 0; i < m->numel(); ++i) m->set(i, std::fabs(m->get(i)));
  cpu_ops().gemm(bound_dx, abs_dl, false, abs_w, false, 1, 0);
  cpu_ops().gemm(bound_dw, abs_dl, true, abs_x, false, 1, 0);
}

// Elements with |got − ref| > rel·bound + out_rel·|ref| + atol.
int64_t count_bound_mismatches(const HostTensor& got, const HostTensor& ref,
                               const HostTensor& bound, double rel, double out_rel) {
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double tol = rel * bound.get(i) + out_rel * std::fabs(ref.get(i)) + 1e-30;
    if (!(std::fabs(got.get(i) - ref.get(i)) <= tol)) ++bad;
  }
  return bad;
}

}  // namespace

TEST_CASE("cuda lmhead_ce forward and backward equal the CPU reference; fwd_bwd equals them bitwise",
          "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  const LmCase cases[] = {
      {7, 16, 37, 3},       // V % 4 ≠ 0 (scalar kernels), chunk does not divide T
      {64, 128, 1000, 64},  // float4 kernels, one chunk
      {64, 128, 1000, 24},  // three chunks, the last one partial
      {5, 8, 257, 16},      // the tiny model's vocabulary, chunk larger than T
  };
  const float grad_scale = 0.7f;
  uint64_t seed = 40;
  for (const LmCase& c : cases) {
    INFO("T " << c.tokens << " H " << c.hidden << " V " << c.vocab << " chunk " << c.chunk);
    HostTensor x = dyadic_tensor({c.tokens, c.hidden}, ++seed);
    HostTensor w = dyadic_tensor({c.vocab, c.hidden}, ++seed);
    HostTensor targets = make_targets(c.tokens, c.vocab, ++seed);
    HostTensor dw0 = dyadic_tensor({c.vocab, c.hidden}, ++seed);

    HostTensor loss_ref(DType::F32, {c.tokens}), lse_ref(DType::F32, {c.tokens});
    HostTensor ws_ref(DType::F32, {c.chunk, c.vocab});
    cpu_ops().lmhead_ce_fwd(loss_ref, lse_ref, x, w, targets, ws_ref);
    HostTensor dx_ref(DType::F32, {c.tokens, c.hidden}), dw_ref = dw0;
    cpu_ops().lmhead_ce_bwd(dx_ref, dw_ref, x, w, targets, lse_ref, grad_scale, ws_ref);

    HostTensor bound_dx(DType::F32, {c.tokens, c.hidden}),
        bound_dw(DType::F32, {c.vocab, c.hidden});
    dlogits_bounds(bound_dx, bound_dw, x, w, targets, lse_ref, grad_scale, c);
    // fp32 sums of V (dx) or T (dw) terms on both sides: 2·n·u of the same Σ|·|.
    const double dx_rel = kDlogitsRel + 2 * double(c.vocab) * kUlp;
    const double dw_rel = kDlogitsRel + 2 * double(c.tokens) * kUlp;

    DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16);
    DeviceTensor d_targets = upload(targets);
    DeviceTensor ws(DType::F32, {c.chunk, c.vocab});
    DeviceTensor loss(DType::F32, {c.tokens}), lse(DType::F32, {c.tokens});
    DeviceTensor dx(DType::BF16, {c.tokens, c.hidden});
    HostTensor first_loss, first_lse, first_dx, first_dw;
    for (int run = 0; run < 2; ++run) {
      INFO("run " << run);
      for (const DeviceTensor* t : {&ws, &loss, &lse, &dx}) poison(*t);
      DeviceTensor dw = upload(dw0, DType::F32);
      // Run 0 forward then backward, run 1 the training form (both at once): the same bits.
      if (run == 0) {
        ops.lmhead_ce_fwd(loss, lse, d_x, d_w, d_targets, ws);
        ops.lmhead_ce_bwd(dx, dw, d_x, d_w, d_targets, lse, grad_scale, ws);
      } else {
        ops.lmhead_ce_fwd_bwd(loss, lse, dx, dw, d_x, d_w, d_targets, grad_scale, ws);
      }
      HostTensor got_loss = download(loss), got_lse = download(lse);
      HostTensor got_dx = download(dx), got_dw = download(dw);
      CHECK(count_mismatches(got_lse, lse_ref, lse_atol(c.vocab), 0) == 0);
      CHECK(count_mismatches(got_loss, loss_ref, lse_atol(c.vocab), 0) == 0);
      for (int64_t t = 0; t < c.tokens; ++t)
        if (targets.ptr<int32_t>()[t] < 0) CHECK(got_loss.get(t) == 0.0);

      CHECK(count_bound_mismatches(got_dx, dx_ref, bound_dx, dx_rel, kBf16Ulp) == 0);
      CHECK(count_bound_mismatches(got_dw, dw_ref, bound_dw, dw_rel, 0) == 0);
      CHECK(max_abs(got_dx) > 0);

      if (run == 0) {
        first_loss = got_loss;
        first_lse = got_lse;
        first_dx = got_dx;
        first_dw = got_dw;
      } else {
        CHECK(bitwise_equal(got_loss, first_loss));
        CHECK(bitwise_equal(got_lse, first_lse));
        CHECK(bitwise_equal(got_dx, first_dx));
        CHECK(bitwise_equal(got_dw, first_dw));
      }
    }
  }
}

TEST_CASE("cuda lmhead_ce: all targets masked give zero loss and dx, dw unchanged", "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  // Every target masked: loss 0, dx 0, dw unchanged (bitwise), lse still the row's log-sum-exp.
  const LmCase c{6, 16, 40, 4};
  HostTensor x = dyadic_tensor({c.tokens, c.hidden}, 7), w = dyadic_tensor({c.vocab, c.hidden}, 8);
  HostTensor targets(DType::I32, {c.tokens});
  for (int64_t t = 0; t < c.tokens; ++t) targets.ptr<int32_t>()[t] = -1;
  HostTensor dw0 = dyadic_tensor({c.vocab, c.hidden}, 9);
  HostTensor loss_ref(DType::F32, {c.tokens}), lse_ref(DType::F32, {c.tokens});
  HostTensor ws_ref(DType::F32, {c.chunk, c.vocab});
  cpu_ops().lmhead_ce_fwd(loss_ref, lse_ref, x, w, targets, ws_ref);

  DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16), d_t = upload(targets);
  DeviceTensor ws(DType::F32, {c.chunk, c.vocab}), loss(DType::F32, {c.tokens});
  DeviceTensor lse(DType::F32, {c.tokens}), dx(DType::BF16, {c.tokens, c.hidden});
  DeviceTensor dw = upload(dw0, DType::F32);
  for (const DeviceTensor* t : {&loss, &lse, &dx}) poison(*t);
  ops.lmhead_ce_fwd(loss, lse, d_x, d_w, d_t, ws);
  ops.lmhead_ce_bwd(dx, dw, d_x, d_w, d_t, lse, 1.0f, ws);
  // count_mismatches, not max_abs: a NaN left by the poison must count.
  CHECK(count_mismatches(download(loss), HostTensor(DType::F32, {c.tokens}), 0, 0) == 0);
  CHECK(count_mismatches(download(lse), lse_ref, lse_atol(c.vocab), 0) == 0);
  CHECK(count_mismatches(download(dx), HostTensor(DType::F32, {c.tokens, c.hidden}), 0, 0) == 0);
  CHECK(bitwise_equal(download(dw), dw0));
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
