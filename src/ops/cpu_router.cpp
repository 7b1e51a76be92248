// CPU reference: MoE router (softmax → top-k → optional renormalisation) forward and backward, and
// the load-balancing / z-loss of one layer. Everything is in the acc dtype; one thread per token
// row, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/cpu_ops.h"

namespace mop::cpu {
namespace {

template <class T>
void router_fwd_impl(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse, const Tensor& logits,
                     bool renormalize) {
  const int64_t num_tokens = logits.shape[0], num_experts = logits.shape[1];
  const int64_t top_k = topk_idx.shape[1];
#pragma omp parallel
  {
    std::vector<int32_t> order(static_cast<size_t>(num_experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      const T* z = logits.ptr<T>() + t * num_experts;
      T* p = probs.ptr<T>() + t * num_experts;
      T m = z[0];
      for (int64_t e = 1; e < num_experts; ++e) m = std::max(m, z[e]);
      T s = 0;
      for (int64_t e = 0; e < num_experts; ++e) {
        p[e] = std::exp(z[e] - m);
        s += p[e];
      }
      for (int64_t e = 0; e < num_experts; ++e) p[e] /= s;
      lse.ptr<T>()[t] = m + std::log(s);
      // Descending probability; equal probabilities keep the lower expert index first.
      std::iota(order.begin(), order.end(), 0);
      std::partial_sort(
          order.begin(), order.begin() + top_k, order.end(),
          [p](int32_t a, int32_t b) { return p[a] > p[b] || (p[a] == p[b] && a < b); });
      int32_t* idx = topk_idx.ptr<int32_t>() + t * top_k;
      T* w = topk_w.ptr<T>() + t * top_k;
      T sel = 0;
      for (int64_t k = 0; k < top_k; ++k) {
        idx[k] = order[size_t(k)];
        w[k] = p[idx[k]];
        sel += w[k];
      }
      if (renormalize)
        for (int64_t k = 0; k < top_k; ++k) w[k] /= sel;
    }
  }
}

template <class T>
void router_bwd_impl(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs, const Tensor& lse,
                     const Tensor& topk_idx, const Tensor& topk_w, const Tensor& aux_grad,
                     T z_grad_scale, bool renormalize) {
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  const int64_t top_k = topk_idx.shape[1];
#pragma omp parallel
  {
    std::vector<T> dp(static_cast<size_t>(num_experts));
#pragma omp for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      const T* p = probs.ptr<T>() + t * num_experts;
      const int32_t* idx = topk_idx.ptr<int32_t>() + t * top_k;
      const T* w = topk_w.ptr<T>() + t * top_k;
      const T* dw = dtopk_w.ptr<T>() + t * top_k;
      // dp = ∂L/∂probs: the load-balancing term for every expert, then the top-k weights.
      for (int64_t e = 0; e < num_experts; ++e) dp[size_t(e)] = aux_grad.ptr<T>()[e];
      if (renormalize) {
        // w_k = p_k / s with s = Σ_k p_k  ⇒  ∂L/∂p_j = (dw_j − Σ_k dw_k·w_k) / s.
        T s = 0, dot = 0;
        for (int64_t k = 0; k < top_k; ++k) s += p[idx[k]];
        for (int64_t k = 0; k < top_k; ++k) dot += dw[k] * w[k];
        for (int64_t k = 0; k < top_k; ++k) dp[size_t(idx[k])] += (dw[k] - dot) / s;
      } else {
        for (int64_t k = 0; k < top_k; ++k) dp[size_t(idx[k])] += dw[k];
      }
      // Softmax backward, plus z-loss: ∂(lse²)/∂z_j = 2·lse·p_j.
      T pdp = 0;
      for (int64_t e = 0; e < num_experts; ++e) pdp += p[e] * dp[size_t(e)];
      const T z_coef = z_grad_scale * T(2) * lse.ptr<T>()[t];
      T* dz = dlogits.ptr<T>() + t * num_experts;
      for (int64_t e = 0; e < num_experts; ++e)
        dz[e] = p[e] * (dp[size_t(e)] - pdp) + z_coef * p[e];
    }
  }
}

void check_topk_idx(const Tensor& topk_idx, int64_t num_experts, const char* op) {
  const int32_t* idx = topk_idx.ptr<int32_t>();
  for (int64_t i = 0; i < topk_idx.numel(); ++i)
    MOP_CHECK(idx[i] >= 0 && idx[i] < num_experts, op, ": topk_idx[", i, "] = ", idx[i],
              " outside [0, ", num_experts, ")");
}

}  // namespace

void router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse, const Tensor& logits,
                bool renormalize) {
  DType dt = compute_dtype(logits, "router_fwd: logits");
  MOP_CHECK(logits.ndim == 2 && topk_idx.ndim == 2, "router_fwd: logits ", logits.shape_str(),
            " and topk_idx ", topk_idx.shape_str(), " must be [T,E] and [T,K]");
  const int64_t num_tokens = logits.shape[0], num_experts = logits.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(top_k >= 1 && top_k <= num_experts, "router_fwd: top_k = ", top_k, " with ",
            num_experts, " experts");
  expect(topk_idx, "router_fwd: topk_idx", DType::I32, {num_tokens, top_k});
  expect(topk_w, "router_fwd: topk_w", dt, {num_tokens, top_k});
  expect(probs, "router_fwd: probs", dt, {num_tokens, num_experts});
  expect(lse, "router_fwd: lse", dt, {num_tokens});
  dispatch_float(dt, [&](auto tag) {
    router_fwd_impl<decltype(tag)>(topk_idx, topk_w, probs, lse, logits, renormalize);
  });
}

void router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs, const Tensor& lse,
                const Tensor& topk_idx, const Tensor& topk_w, const Tensor& aux_grad,
                float z_grad_scale, bool renormalize) {
  DType dt = compute_dtype(probs, "router_bwd: probs");
  MOP_CHECK(probs.ndim == 2 && topk_idx.ndim == 2, "router_bwd: probs ", probs.shape_str(),
            " and topk_idx ", topk_idx.shape_str(), " must be [T,E] and [T,K]");
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(top_k >= 1 && top_k <= num_experts, "router_bwd: top_k = ", top_k, " with ",
            num_experts, " experts");
  expect(dlogits, "router_bwd: dlogits", dt, {num_tokens, num_experts});
  expect(dtopk_w, "router_bwd: dtopk_w", dt, {num_tokens, top_k});
  expect(lse, "router_bwd: lse", dt, {num_tokens});
  expect(topk_idx, "router_bwd: topk_idx", DType::I32, {num_tokens, top_k});
  expect(topk_w, "router_bwd: topk_w", dt, {num_tokens, top_k});
  expect(aux_grad, "router_bwd: aux_grad", dt, {num_experts});
  check_topk_idx(topk_idx, num_experts, "router_bwd");
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    router_bwd_impl<T>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, T(z_grad_scale),
                       renormalize);
  });
}

void moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                  const Tensor& counts, int top_k, float aux_coef, float z_coef) {
  DType dt = compute_dtype(probs, "moe_aux_loss: probs");
  MOP_CHECK(probs.ndim == 2, "moe_aux_loss: probs must be [T,E], is ", probs.shape_str());
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  MOP_CHECK(num_tokens > 0 && top_k >= 1 && top_k <= num_experts, "moe_aux_loss: T = ", num_tokens,
            ", top_k = ", top_k, ", E = ", num_experts);
  expect(losses, "moe_aux_loss: losses", dt, {2});
  expect(aux_grad, "moe_aux_loss: aux_grad", dt, {num_experts});
  expect(lse, "moe_aux_loss: lse", dt, {num_tokens});
  expect(counts, "moe_aux_loss: counts", DType::I32, {num_experts});
  const int32_t* cnt = counts.ptr<int32_t>();
  for (int64_t e = 0; e < num_experts; ++e)
    MOP_CHECK(cnt[e] >= 0, "moe_aux_loss: counts[", e, "] = ", cnt[e]);
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* p = probs.ptr<T>();
    const T tokens = T(num_tokens), experts = T(num_experts), k = T(top_k);
    // aux = E/(T·K) · Σ_e counts[e] · mean_t probs[t,e]; sums run over t, then e, in order.
    std::vector<T> col(size_t(num_experts), T(0));
    for (int64_t t = 0; t < num_tokens; ++t)
      for (int64_t e = 0; e < num_experts; ++e) col[size_t(e)] += p[t * num_experts + e];
    T balance = 0;
    for (int64_t e = 0; e < num_experts; ++e) balance += T(cnt[e]) * (col[size_t(e)] / tokens);
    const T aux = experts / (tokens * k) * balance;
    T z = 0;
    for (int64_t t = 0; t < num_tokens; ++t) z += lse.ptr<T>()[t] * lse.ptr<T>()[t];
    z /= tokens;
    losses.ptr<T>()[0] += T(aux_coef) * aux;
    losses.ptr<T>()[1] += T(z_coef) * z;
    for (int64_t e = 0; e < num_experts; ++e)
      aux_grad.ptr<T>()[e] = T(aux_coef) * experts * T(cnt[e]) / (tokens * tokens * k);
  });
}

}  // namespace mop::cpu
