// router: the CPU reference softmax / top-k / renormalisation against an independent sort (ties
// to the lower expert), router_bwd against finite differences, moe_aux_loss against its formula
// and aux_grad against finite differences; the CUDA backend ([gpu]) against the reference over
// T = 1, a prime, E not a multiple of 32, K = 1 and K = E, q3moe's shape, E up to 1,024.

#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

namespace {

// fp64 evaluations of the same formula in a different order differ by a few ulps of O(1) values.
constexpr double kFp64Tol = 1e-12;

struct RouterOut {
  HostTensor idx, w, probs, lse;
  // Out of line: inlined into the loops below, g++ 12 -O3 reports a false -Wmaybe-uninitialized
  // inside HostTensor's constructor.
  [[gnu::noinline]] RouterOut(DType dt, int64_t tokens, int64_t experts, int64_t top_k)
      : idx(DType::I32, {tokens, top_k}),
        w(dt, {tokens, top_k}),
        probs(dt, {tokens, experts}),
        lse(dt, {tokens}) {}
};

}  // namespace

TEST_CASE("router forward: softmax, top-k order with ties, renormalisation", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 9, experts = 7;
  HostTensor logits = random_tensor(DType::F64, {tokens, experts}, 1, -3, 3);
  // Row 0 has a three-way tie for the top and a tie further down.
  const double row0[] = {1.0, 3.0, 3.0, 0.0, 3.0, -1.0, 0.0};
  for (int64_t e = 0; e < experts; ++e) logits.set(e, row0[e]);
  for (int64_t top_k : {int64_t(1), int64_t(3), experts})
    for (bool renorm : {false, true}) {
      INFO("top_k " << top_k << " renormalize " << renorm);
      RouterOut r(DType::F64, tokens, experts, top_k);
      ops.router_fwd(r.idx, r.w, r.probs, r.lse, logits, renorm);
      for (int64_t t = 0; t < tokens; ++t) {
        double m = -INFINITY, s = 0;
        for (int64_t e = 0; e < experts; ++e) m = std::max(m, logits.get(t * experts + e));
        for (int64_t e = 0; e < experts; ++e) s += std::exp(logits.get(t * experts + e) - m);
        CHECK(std::fabs(r.lse.get(t) - (m + std::log(s))) < kFp64Tol);
        std::vector<double> p(static_cast<size_t>(experts));
        for (int64_t e = 0; e < experts; ++e) {
          p[size_t(e)] = std::exp(logits.get(t * experts + e) - m) / s;
          CHECK(std::fabs(r.probs.get(t * experts + e) - p[size_t(e)]) < kFp64Tol);
        }
        // Independent order: a stable sort by descending probability keeps lower indices first.
        std::vector<int32_t> order(static_cast<size_t>(experts));
        std::iota(order.begin(), order.end(), 0);
        std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
          return r.probs.get(t * experts + a) > r.probs.get(t * experts + b);
        });
        double sel = 0;
        for (int64_t k = 0; k < top_k; ++k) sel += p[size_t(order[size_t(k)])];
        for (int64_t k = 0; k < top_k; ++k) {
          const int32_t e = order[size_t(k)];
          CHECK(r.idx.ptr<int32_t>()[t * top_k + k] == e);
          const double want = renorm ? p[size_t(e)] / sel : p[size_t(e)];
          CHECK(std::fabs(r.w.get(t * top_k + k) - want) < kFp64Tol);
        }
      }
      if (top_k == 3) {  // the tie in row 0: experts 1, 2, 4 in index order
        CHECK(r.idx.ptr<int32_t>()[0] == 1);
        CHECK(r.idx.ptr<int32_t>()[1] == 2);
        CHECK(r.idx.ptr<int32_t>()[2] == 4);
      }
    }
}

TEST_CASE("router backward matches finite differences (fp64)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 5, experts = 7;
  for (int64_t top_k : {int64_t(1), int64_t(2), int64_t(3), experts})
    for (bool renorm : {false, true}) {
      INFO("top_k " << top_k << " renormalize " << renorm);
      RouterOut r(DType::F64, tokens, experts, top_k);
      HostTensor logits = random_tensor(DType::F64, {tokens, experts}, 2, -2, 2);
      HostTensor w_weights = random_tensor(DType::F64, {tokens, top_k}, 3);
      HostTensor aux_grad = random_tensor(DType::F64, {experts}, 4);
      const float z_grad_scale = 0.3f;
      // L = Σ W ⊙ topk_w + Σ_t,e aux_grad[e]·probs[t,e] + z_grad_scale·Σ_t lse_t².
      auto loss = [&] {
        ops.router_fwd(r.idx, r.w, r.probs, r.lse, logits, renorm);
        double l = weighted_sum(w_weights, r.w);
        for (int64_t t = 0; t < tokens; ++t) {
          for (int64_t e = 0; e < experts; ++e) l += aux_grad.get(e) * r.probs.get(t * experts + e);
          l += double(z_grad_scale) * r.lse.get(t) * r.lse.get(t);
        }
        return l;
      };
      loss();
      HostTensor dlogits(DType::F64, {tokens, experts});
      ops.fill(dlogits, std::nan(""));
      ops.router_bwd(dlogits, w_weights, r.probs, r.lse, r.idx, r.w, aux_grad, z_grad_scale,
                     renorm);
      check_grad("router logits", logits, dlogits, loss);
    }
}

TEST_CASE("moe_aux_loss equals its formula; aux_grad is its gradient", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 6, experts = 5, top_k = 2;
  HostTensor logits = random_tensor(DType::F64, {tokens, experts}, 5, -2, 2);
  RouterOut r(DType::F64, tokens, experts, top_k);
  ops.router_fwd(r.idx, r.w, r.probs, r.lse, logits, true);
  HostTensor counts(DType::I32, {experts});
  const int32_t cnt[] = {4, 0, 3, 1, 4};  // sums to T·K = 12; expert 1 gets nothing
  for (int64_t e = 0; e < experts; ++e) counts.ptr<int32_t>()[e] = cnt[e];
  const float aux_coef = 0.01f, z_coef = 0.001f;
  HostTensor losses(DType::F64, {2}), aux_grad(DType::F64, {experts});
  losses.set(0, 0.5);
  losses.set(1, -0.25);  // the op adds
  ops.fill(aux_grad, std::nan(""));
  ops.moe_aux_loss(losses, aux_grad, r.probs, r.lse, counts, top_k, aux_coef, z_coef);
  double aux = 0, z = 0;
  for (int64_t e = 0; e < experts; ++e) {
    double mean_p = 0;
    for (int64_t t = 0; t < tokens; ++t) mean_p += r.probs.get(t * experts + e) / tokens;
    aux += double(cnt[e]) / (tokens * top_k) * mean_p;
  }
  aux *= experts;
  for (int64_t t = 0; t < tokens; ++t) z += r.lse.get(t) * r.lse.get(t) / tokens;
  CHECK(aux > 0.5);  // E·Σ f_e·P_e is ≈ 1 for a roughly balanced router
  CHECK(std::fabs(losses.get(0) - (0.5 + double(aux_coef) * aux)) < kFp64Tol);
  CHECK(std::fabs(losses.get(1) - (-0.25 + double(z_coef) * z)) < kFp64Tol);
  CHECK(aux_grad.get(1) == 0.0);

  // aux_grad[e] = ∂(aux_coef·aux)/∂probs[t,e] for every t (counts held fixed).
  HostTensor probs = r.probs, grad(DType::F64, {tokens, experts});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t e = 0; e < experts; ++e) grad.set(t * experts + e, aux_grad.get(e));
  HostTensor scratch(DType::F64, {experts});
  auto aux_loss = [&] {
    HostTensor l(DType::F64, {2});
    ops.moe_aux_loss(l, scratch, probs, r.lse, counts, top_k, aux_coef, z_coef);
    return l.get(0);
  };
  check_grad("aux loss probs", probs, grad, aux_loss);

  // Composition used by the model: router_bwd with this aux_grad and z_grad_scale = z_coef/T
  // gives the gradient of both losses with respect to the router logits.
  auto both = [&] {
    ops.router_fwd(r.idx, r.w, r.probs, r.lse, logits, true);
    HostTensor l(DType::F64, {2});
    ops.moe_aux_loss(l, scratch, r.probs, r.lse, counts, top_k, aux_coef, z_coef);
    return l.get(0) + l.get(1);
  };
  both();
  HostTensor zero_dw(DType::F64, {tokens, top_k}), dlogits(DType::F64, {tokens, experts});
  ops.router_bwd(dlogits, zero_dw, r.probs, r.lse, r.idx, r.w, aux_grad,
                 float(double(z_coef) / tokens), true);
  // z_coef/T is rounded to fp32 on the way in; its relative error 6e-8 on a term ≈ 3e-4 stays
  // far inside the finite-difference tolerance.
  check_grad("aux + z loss logits", logits, dlogits, both);
}

TEST_CASE("router in f32 agrees with f64", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 16, experts = 8, top_k = 2;
  HostTensor logits64 = bf16_exact_tensor(DType::F64, {tokens, experts}, 6, -4, 4);
  HostTensor dw64 = bf16_exact_tensor(DType::F64, {tokens, top_k}, 7);
  HostTensor aux64 = bf16_exact_tensor(DType::F64, {experts}, 8);
  RouterOut r64(DType::F64, tokens, experts, top_k), r32(DType::F32, tokens, experts, top_k);
  HostTensor d64(DType::F64, {tokens, experts}), d32(DType::F32, {tokens, experts});
  ops.router_fwd(r64.idx, r64.w, r64.probs, r64.lse, logits64, true);
  ops.router_fwd(r32.idx, r32.w, r32.probs, r32.lse, converted(logits64, DType::F32), true);
  ops.router_bwd(d64, dw64, r64.probs, r64.lse, r64.idx, r64.w, aux64, 0.1f, true);
  ops.router_bwd(d32, converted(dw64, DType::F32), r32.probs, r32.lse, r32.idx, r32.w,
                 converted(aux64, DType::F32), 0.1f, true);
  CHECK(bitwise_equal(r32.idx, r64.idx));  // no near-ties in this draw
  CHECK(max_abs_diff(r32.w, r64.w) < kF32VsF64Tol);
  CHECK(max_abs_diff(r32.probs, r64.probs) < kF32VsF64Tol);
  CHECK(max_abs_diff(r32.lse, r64.lse) < kF32VsF64Tol);
  CHECK(max_abs_diff(d32, d64) < kF32VsF64Tol);
}

TEST_CASE("router ops reject bad shapes and indices", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  HostTensor logits(DType::F32, {3, 4});
  RouterOut r(DType::F32, 3, 4, 2);
  CHECK_NOTHROW(ops.router_fwd(r.idx, r.w, r.probs, r.lse, logits, true));
  RouterOut too_many(DType::F32, 3, 4, 5);
  CHECK_THROWS_AS(
      ops.router_fwd(too_many.idx, too_many.w, too_many.probs, too_many.lse, logits, true), Error);
  HostTensor aux3(DType::F32, {3}), aux4(DType::F32, {4}), d(DType::F32, {3, 4});
  CHECK_THROWS_AS(ops.router_bwd(d, r.w, r.probs, r.lse, r.idx, r.w, aux3, 0, true), Error);
  r.idx.ptr<int32_t>()[1] = 4;
  CHECK_THROWS_AS(ops.router_bwd(d, r.w, r.probs, r.lse, r.idx, r.w, aux4, 0, true), Error);
  HostTensor counts(DType::I32, {4}), losses(DType::F32, {2}), lse64(DType::F64, {3});
  CHECK_THROWS_AS(ops.moe_aux_loss(losses, aux4, r.probs, lse64, counts, 2, 1, 1), Error);
  CHECK_THROWS_AS(ops.moe_aux_loss(losses, aux4, r.probs, r.lse, counts, 0, 1, 1), Error);
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include "catch.h"
#include "gpu/moe_test_util.h"

namespace cuda {
using namespace mop;
using namespace mop::test;

namespace {

constexpr double kF32Eps = 1.0 / (1 << 24);  // unit roundoff of fp32 (half an ulp at 1)
constexpr int64_t kExact = 0;

// Softmax: the GPU sums the E exponentials in another order than the reference (lanes, then a
// butterfly; the reference sequentially) and CUDA's expf is within 2 ulp: a relative error of at
// most (E−1)·u for the sum plus a few ulp: 2e-5 for E ≤ 256, (E + 8)·u above.
double prob_rtol(int64_t experts) {
  return std::max(2e-5, double(experts + 8) * kF32Eps);
}
// lse = m + log(s): the sum's relative error becomes an absolute one, plus log's ulps.
double lse_atol(int64_t experts) {
  return prob_rtol(experts);
}
constexpr double kLseRtol = 1e-6;

struct RouterCase {
  int64_t tokens, experts, top_k;
};
const RouterCase kRouterCases[] = {
    {1, 5, 2},
    {13, 5, 2},
    {13, 5, 1},
    {13, 5, 5},
    {1000, 128, 8},
    {37, 256, 8},
    {29, 33, 4},
    {8, 1, 1},
    {40, 64, 64},
    {21, 100, 33},
    // past 256 experts (moe-1t's 384, up to the 1024 the permutation holds): 12, 16 and 32 per lane
    {45, 384, 8},
    {19, 500, 20},
    {11, 1024, 8},
};

// bf16-exact logits in [-3, 3] (distinct values differ far beyond expf's error, equal ones tie
// exactly on both sides); row 0 is one value everywhere, row 1 cycles through three values.
HostTensor make_logits(int64_t tokens, int64_t experts, uint64_t seed) {
  HostTensor logits(DType::F32, {tokens, experts});
  fill_uniform(logits, seed, -3, 3);
  for (int64_t e = 0; e < experts; ++e) {
    logits.set(e, 0.5);
    if (tokens > 1) logits.set(experts + e, double(e % 3));
  }
  return logits;
}

struct HostRouter {
  HostTensor idx, w, probs, lse;
  [[gnu::noinline]] HostRouter(int64_t tokens, int64_t experts, int64_t top_k)
      : idx(DType::I32, {tokens, top_k}),
        w(DType::F32, {tokens, top_k}),
        probs(DType::F32, {tokens, experts}),
        lse(DType::F32, {tokens}) {}
};

struct DeviceRouter {
  DeviceTensor idx, w, probs, lse;
  [[gnu::noinline]] DeviceRouter(int64_t tokens, int64_t experts, int64_t top_k)
      : idx(DType::I32, {tokens, top_k}),
        w(DType::F32, {tokens, top_k}),
        probs(DType::F32, {tokens, experts}),
        lse(DType::F32, {tokens}) {}
  void poison_all() const {
    for (const DeviceTensor* t : {&idx, &w, &probs, &lse}) poison(*t);
    settle();
  }
};

HostRouter cpu_router_fwd(const HostTensor& logits, int64_t top_k, bool renorm) {
  HostRouter r(logits.t.shape[0], logits.t.shape[1], top_k);
  make_cpu_ops()->router_fwd(r.idx, r.w, r.probs, r.lse, logits, renorm);
  return r;
}

}  // namespace

TEST_CASE("router_fwd matches the CPU reference, ties to the lower expert", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  for (const RouterCase& c : kRouterCases)
    for (bool renorm : {false, true}) {
      INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " renormalize " << renorm);
      HostTensor logits = make_logits(c.tokens, c.experts, 11);
      HostRouter ref = cpu_router_fwd(logits, c.top_k, renorm);
      DeviceTensor d_logits = upload(logits);
      DeviceRouter d(c.tokens, c.experts, c.top_k);
      d.poison_all();
      ops->router_fwd(d.idx, d.w, d.probs, d.lse, d_logits, renorm);
      HostTensor idx = download(d.idx), w = download(d.w), probs = download(d.probs),
                 lse = download(d.lse);
      CHECK(count_mismatches(idx, ref.idx, 0, 0) == kExact);
      CHECK(count_mismatches(probs, ref.probs, 0, prob_rtol(c.experts)) == 0);
      CHECK(count_mismatches(lse, ref.lse, lse_atol(c.experts), kLseRtol) == 0);
      // Renormalised weights are ratios of probabilities: the sum's error cancels.
      CHECK(count_mismatches(w, ref.w, 0, prob_rtol(c.experts)) == 0);
      // Row 0 is a full tie: experts 0..K−1 in order. Row 1 = e % 3: the 2s, then the 1s, then
      // the 0s, each group in index order.
      for (int64_t k = 0; k < c.top_k; ++k) CHECK(idx.ptr<int32_t>()[k] == k);
      if (c.tokens > 1) {
        std::vector<int32_t> want;
        for (int r : {2, 1, 0})
          for (int32_t e = 0; e < c.experts; ++e)
            if (e % 3 == r) want.push_back(e);
        for (int64_t k = 0; k < c.top_k; ++k)
          CHECK(idx.ptr<int32_t>()[c.top_k + k] == want[size_t(k)]);
      }
      // Determinism: a second run gives the same bits.
      ops->router_fwd(d.idx, d.w, d.probs, d.lse, d_logits, renorm);
      CHECK(bitwise_equal(download(d.idx), idx));
      CHECK(bitwise_equal(download(d.w), w));
      CHECK(bitwise_equal(download(d.probs), probs));
      CHECK(bitwise_equal(download(d.lse), lse));
    }
}

TEST_CASE("router_bwd matches the CPU reference", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  auto cpu = make_cpu_ops();
  const float z_grad_scale = 0.05f;
  for (const RouterCase& c : kRouterCases)
    for (bool renorm : {false, true}) {
      INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " renormalize " << renorm);
      const int64_t T = c.tokens, E = c.experts, K = c.top_k;
      HostTensor logits = make_logits(T, E, 12);
      logits.set(0, 1.0);  // break row 0's full tie so its top-k sum s differs from K/E
      HostRouter fwd = cpu_router_fwd(logits, K, renorm);
      HostTensor dw(DType::F32, {T, K}), aux_grad(DType::F32, {E});
      fill_uniform(dw, 13);
      fill_uniform(aux_grad, 14, -0.1, 0.1);
      HostTensor ref(DType::F32, {T, E});
      cpu->router_bwd(ref, dw, fwd.probs, fwd.lse, fwd.idx, fwd.w, aux_grad, z_grad_scale, renorm);

      DeviceTensor d_dw = upload(dw), d_probs = upload(fwd.probs), d_lse = upload(fwd.lse),
                   d_idx = upload(fwd.idx), d_w = upload(fwd.w), d_aux = upload(aux_grad);
      DeviceTensor d_dlogits(DType::F32, {T, E});
      poison(d_dlogits);
      settle();
      ops->router_bwd(d_dlogits, d_dw, d_probs, d_lse, d_idx, d_w, d_aux, z_grad_scale, renorm);
      HostTensor got = download(d_dlogits);

      // The GPU forms dp = ∂L/∂probs exactly as the reference (same operations, k order); only
      // Σ_e p·dp is summed in another order, off by ≤ 2·E·u·Σ|p·dp| ≤ 2·E·u·max|dp| (Σp = 1).
      // That error enters dlogits[e] times p[e]; the final products and sum add a few ulps.
      // max|dp| ≤ max|aux_grad| + max|dw|·(renorm ? 2/s : 1), s = the row's selected mass.
      double max_aux = 0;
      for (int64_t e = 0; e < E; ++e) max_aux = std::max(max_aux, std::fabs(aux_grad.get(e)));
      int64_t bad = 0;
      for (int64_t t = 0; t < T; ++t) {
        double s = 0, max_dw = 0;
        for (int64_t k = 0; k < K; ++k) {
          s += fwd.probs.get(t * E + fwd.idx.ptr<int32_t>()[t * K + k]);
          max_dw = std::max(max_dw, std::fabs(dw.get(t * K + k)));
        }
        const double max_dp = max_aux + max_dw * (renorm ? 2 / s : 1);
        for (int64_t e = 0; e < E; ++e) {
          const double p = fwd.probs.get(t * E + e), r = ref.get(t * E + e);
          const double tol = p * max_dp * double(E + 8) * 2 * kF32Eps + 4 * kF32Eps * std::fabs(r);
          const double g = got.get(t * E + e);
          if (!(std::fabs(g - r) <= tol)) ++bad;
        }
      }
      CHECK(bad == 0);
      CHECK(nmse(got, ref) < 1e-10);
      ops->router_bwd(d_dlogits, d_dw, d_probs, d_lse, d_idx, d_w, d_aux, z_grad_scale, renorm);
      CHECK(bitwise_equal(download(d_dlogits), got));
    }
}

TEST_CASE("moe_aux_loss matches the CPU reference; aux_grad bitwise", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  auto cpu = make_cpu_ops();
  struct AuxCase {
    int64_t tokens, experts, top_k;
    int32_t skip;  // an expert that receives no tokens (-1: none)
  };
  const AuxCase cases[] = {{1, 5, 2, -1},     {13, 5, 2, 3},      {13, 5, 5, -1},
                           {1000, 128, 8, 7}, {4099, 128, 8, -1}, {10000, 33, 1, 0},
                           {2000, 384, 8, 5}};
  const float aux_coef = 0.01f, z_coef = 0.001f;
  for (const AuxCase& c : cases) {
    INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " empty " << c.skip);
    const int64_t T = c.tokens, E = c.experts, K = c.top_k;
    HostTensor logits = make_logits(T, E, 15);
    HostRouter fwd = cpu_router_fwd(logits, K, true);
    HostTensor idx = make_topk_idx(T, E, K, 16, c.skip);
    HostPlan plan = cpu_route_plan(idx, E);
    if (c.skip >= 0) CHECK(plan.counts.ptr<int32_t>()[c.skip] == 0);
    const double init[2] = {0.5, -0.25};  // the op adds to the losses
    HostTensor losses(DType::F32, {2}), aux_ref(DType::F32, {E});
    losses.set(0, init[0]);
    losses.set(1, init[1]);
    HostTensor losses_ref = losses;
    cpu->moe_aux_loss(losses_ref, aux_ref, fwd.probs, fwd.lse, plan.counts, int(K), aux_coef,
                      z_coef);

    DeviceTensor d_probs = upload(fwd.probs), d_lse = upload(fwd.lse),
                 d_counts = upload(plan.counts), d_losses = upload(losses);
    DeviceTensor d_aux(DType::F32, {E});
    poison(d_aux);
    settle();
    ops->moe_aux_loss(d_losses, d_aux, d_probs, d_lse, d_counts, int(K), aux_coef, z_coef);
    HostTensor got = download(d_losses), aux = download(d_aux);
    // aux_grad is the reference's own expression on the same counts: bit for bit.
    CHECK(bitwise_equal(aux, aux_ref));
    // Both sides sum T·E probabilities (column sums over T, then E terms) and T squares in
    // different orders: relative errors ≤ (T + E)·u each, so 2·(T + E + 8)·u between them, on the
    // added term; adding it to the initial value costs one more ulp.
    for (int i = 0; i < 2; ++i) {
      const double term = losses_ref.get(i) - init[i];
      const double tol = std::fabs(term) * 2 * double(T + E + 8) * kF32Eps +
                         2 * kF32Eps * std::fabs(losses_ref.get(i));
      INFO("loss " << i << " gpu " << got.get(i) << " cpu " << losses_ref.get(i));
      CHECK(std::fabs(got.get(i) - losses_ref.get(i)) <= tol);
    }
    CHECK(std::fabs(losses_ref.get(0) - init[0]) > 0);
    // Determinism: the same initial losses give the same bits.
    DeviceTensor d_losses2 = upload(losses);
    settle();
    ops->moe_aux_loss(d_losses2, d_aux, d_probs, d_lse, d_counts, int(K), aux_coef, z_coef);
    CHECK(bitwise_equal(download(d_losses2), got));
  }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
