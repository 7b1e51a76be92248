// CUDA backend, router stem: router forward/backward and the load-balancing and z-loss
// (kernels/router.cu); and the MoE family's state (moe_state.h): its creation, preparation, size.
#include "kernels/moe_permute.cuh"
#include "kernels/router.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/moe_state.h"

namespace mop {

void MoeStateDeleter::operator()(MoeState* s) const {
  delete s;
}

MoeState& CudaBackend::moe_state() {
  if (!moe_) moe_.reset(new MoeState());
  return *moe_;
}

void CudaBackend::prepare_moe(const OpShapes& shapes) {
  if (shapes.experts <= 0) return;  // a dense model
  MoeState& st = moe_state();
  const int64_t experts = shapes.experts;
  check_int(experts, "experts");
  reserve_moe(st.plan,
          kernels::route_plan_workspace_bytes(shapes.max_tokens * shapes.top_k, int(experts)),
          stream_);
  reserve_moe(st.aux, kernels::moe_aux_loss_workspace_bytes(int(experts)), stream_);
  reserve_moe(st.host_plan, size_t(2 * experts + 1) * sizeof(int32_t), stream_);
}

size_t CudaBackend::moe_workspace_bytes() const {
  return moe_ ? moe_->plan.bytes() + moe_->aux.bytes() + moe_->host_plan.bytes() : 0;
}

void CudaBackend::router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse,
                         const Tensor& logits, bool renormalize) {
  const int64_t num_tokens = logits.shape[0], num_experts = logits.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(num_experts <= kernels::kRouterMaxExperts, "router_fwd: ", num_experts,
            " experts (at most ", kernels::kRouterMaxExperts, ")");
  check_int(num_tokens, "router_fwd: tokens");
  kernels::launch_router_fwd(topk_idx.ptr<int32_t>(), topk_w.ptr<float>(), probs.ptr<float>(),
                             lse.ptr<float>(), logits.ptr<float>(), int(num_tokens),
                             int(num_experts), int(top_k), renormalize, stream_);
}

void CudaBackend::router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs,
                         const Tensor& lse, const Tensor& topk_idx, const Tensor& topk_w,
                         const Tensor& aux_grad, float z_grad_scale, bool renormalize) {
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(num_experts <= kernels::kRouterMaxExperts, "router_bwd: ", num_experts,
            " experts (at most ", kernels::kRouterMaxExperts, ")");
  check_int(num_tokens, "router_bwd: tokens");
  kernels::launch_router_bwd(dlogits.ptr<float>(), dtopk_w.ptr<float>(), probs.ptr<float>(),
                             lse.ptr<float>(), topk_idx.ptr<int32_t>(), topk_w.ptr<float>(),
                             aux_grad.ptr<float>(), z_grad_scale, int(num_tokens), int(num_experts),
                             int(top_k), renormalize, stream_);
}

void CudaBackend::moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                           const Tensor& counts, int top_k, float aux_coef, float z_coef) {
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  check_int(num_tokens, "moe_aux_loss: tokens");
  check_int(num_experts, "moe_aux_loss: experts");
  MoeState& st = moe_state();
  reserve_moe(st.aux, kernels::moe_aux_loss_workspace_bytes(int(num_experts)), stream_);
  kernels::launch_moe_aux_loss(losses.ptr<float>(), aux_grad.ptr<float>(), st.aux.data(),
                               probs.ptr<float>(), lse.ptr<float>(), counts.ptr<int32_t>(),
                               int(num_tokens), int(num_experts), top_k, aux_coef, z_coef, stream_);
}

}  // namespace mop
