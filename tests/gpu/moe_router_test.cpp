// [gpu][moe] router kernels against the CPU reference: router_fwd (top-k indices exact, ties to
// the lower expert index — bf16-rounded logits collide often, and two rows are built from ties),
// router_bwd with and without renormalisation, moe_aux_loss (aux_grad bitwise, losses within the
// reordering bound), over T = 1, a prime, E not a multiple of 32, K = 1 and K = E, and the q3moe
// shape (E = 128, K = 8); plus run-to-run bitwise determinism.
#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <vector>

#include "catch.h"
#include "gpu/moe_test_util.h"

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

#endif  // MOP_HAVE_CUDA
