// CPU reference: MoE router (softmax → top-k → optional renormalisation) forward and backward, and
// the load-balancing / z-loss of one layer. Everything is in the acc dtype; one thread per token
// row, so results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <numeric>
#include <vector>

#include "ops/cpu/cpu.h"

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

void CpuBackend::router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse,
                            const Tensor& logits, bool renormalize) {
  dispatch_float(logits.dtype, [&](auto tag) {
    router_fwd_impl<decltype(tag)>(topk_idx, topk_w, probs, lse, logits, renormalize);
  });
}

void CpuBackend::router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs,
                            const Tensor& lse, const Tensor& topk_idx, const Tensor& topk_w,
                            const Tensor& aux_grad, float z_grad_scale, bool renormalize) {
  check_topk_idx(topk_idx, probs.shape[1], "router_bwd");
  dispatch_float(probs.dtype, [&](auto tag) {
    using T = decltype(tag);
    router_bwd_impl<T>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, T(z_grad_scale),
                       renormalize);
  });
}

void CpuBackend::moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs,
                              const Tensor& lse, const Tensor& counts, int top_k, float aux_coef,
                              float z_coef) {
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  const int32_t* cnt = counts.ptr<int32_t>();
  for (int64_t e = 0; e < num_experts; ++e)
    MOP_CHECK(cnt[e] >= 0, "moe_aux_loss: counts[", e, "] = ", cnt[e]);
  dispatch_float(probs.dtype, [&](auto tag) {
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
