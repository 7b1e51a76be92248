// Front of the router (softmax, top-k; backward) and its load-balancing loss: the checks, then the
// backend's hooks (cpu/router.cpp, cuda/router.cpp, kernels/router.cu). Router tensors are acc.
#include "core/error.h"
#include "ops/ops.h"

namespace mop {

void Ops::router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse,
                     const Tensor& logits, bool renormalize) {
  MOP_CHECK(logits.ndim == 2 && topk_idx.ndim == 2, "router_fwd: logits ", logits.shape_str(),
            " and topk_idx ", topk_idx.shape_str(), " must be [T,E] and [T,K]");
  const DType dt = acc_dtype_of(logits, "router_fwd: logits");
  const int64_t num_tokens = logits.shape[0], num_experts = logits.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(top_k >= 1 && top_k <= num_experts, "router_fwd: top_k = ", top_k, " with ",
            num_experts, " experts");
  expect(logits, "router_fwd: logits", dt, {num_tokens, num_experts});
  expect(topk_idx, "router_fwd: topk_idx", DType::I32, {num_tokens, top_k});
  expect(topk_w, "router_fwd: topk_w", dt, {num_tokens, top_k});
  expect(probs, "router_fwd: probs", dt, {num_tokens, num_experts});
  expect(lse, "router_fwd: lse", dt, {num_tokens});
  run(OpId::router_fwd, &OpsBackend::router_fwd, topk_idx, topk_w, probs, lse, logits, renormalize);
}

void Ops::router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs, const Tensor& lse,
                     const Tensor& topk_idx, const Tensor& topk_w, const Tensor& aux_grad,
                     float z_grad_scale, bool renormalize) {
  MOP_CHECK(probs.ndim == 2 && topk_idx.ndim == 2, "router_bwd: probs ", probs.shape_str(),
            " and topk_idx ", topk_idx.shape_str(), " must be [T,E] and [T,K]");
  const DType dt = acc_dtype_of(probs, "router_bwd: probs");
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(top_k >= 1 && top_k <= num_experts, "router_bwd: top_k = ", top_k, " with ",
            num_experts, " experts");
  expect(dlogits, "router_bwd: dlogits", dt, {num_tokens, num_experts});
  expect(dtopk_w, "router_bwd: dtopk_w", dt, {num_tokens, top_k});
  expect(probs, "router_bwd: probs", dt, {num_tokens, num_experts});
  expect(lse, "router_bwd: lse", dt, {num_tokens});
  expect(topk_idx, "router_bwd: topk_idx", DType::I32, {num_tokens, top_k});
  expect(topk_w, "router_bwd: topk_w", dt, {num_tokens, top_k});
  expect(aux_grad, "router_bwd: aux_grad", dt, {num_experts});
  run(OpId::router_bwd, &OpsBackend::router_bwd, dlogits, dtopk_w, probs, lse, topk_idx, topk_w,
      aux_grad, z_grad_scale, renormalize);
}

void Ops::moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                       const Tensor& counts, int top_k, float aux_coef, float z_coef) {
  MOP_CHECK(probs.ndim == 2, "moe_aux_loss: probs must be [T,E], is ", probs.shape_str());
  const DType dt = acc_dtype_of(probs, "moe_aux_loss: probs");
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  MOP_CHECK(num_tokens > 0 && top_k >= 1 && top_k <= num_experts, "moe_aux_loss: T = ", num_tokens,
            ", top_k = ", top_k, ", E = ", num_experts);
  expect(losses, "moe_aux_loss: losses", dt, {2});
  expect(aux_grad, "moe_aux_loss: aux_grad", dt, {num_experts});
  expect(probs, "moe_aux_loss: probs", dt, {num_tokens, num_experts});
  expect(lse, "moe_aux_loss: lse", dt, {num_tokens});
  expect(counts, "moe_aux_loss: counts", DType::I32, {num_experts});
  run(OpId::moe_aux_loss, &OpsBackend::moe_aux_loss, losses, aux_grad, probs, lse, counts, top_k,
      aux_coef, z_coef);
}

}  // namespace mop
