// CPU reference fused LM head + cross-entropy: forward against full logits computed naively,
// chunk sizes that do not divide T (and exceed it), masked targets, finite-difference checks of
// dx and dw, chunk-size and thread-count independence, and f32-vs-f64 agreement.
#include <cmath>
#include <vector>

#include "ops/ops_test_util.h"

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
