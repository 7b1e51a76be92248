// CPU reference router and MoE auxiliary losses: softmax / top-k / renormalisation against an
// independent sort (ties to the lower expert index), router_bwd against finite differences over
// top_k = 1..E, renormalisation on and off, nonzero aux_grad and z-loss, and moe_aux_loss against
// its formula, its aux_grad against finite differences and composed with router_bwd.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/ops_test_util.h"

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
