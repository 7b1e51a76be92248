// CudaOps, MoE family: router forward/backward, the load-balancing and z-loss, the route plan and
// the token permutation into expert order and back (kernels/router.cu, kernels/permute.cu).
// MoeState holds the family's device workspaces: the route plan's per-block histograms (sized by
// prepare_moe from max_tokens·top_k), the aux loss's per-chunk column sums (sized from E), and
// device counts/offsets for callers that ask for the route plan's counts/offsets in host memory.
#include <climits>
#include <initializer_list>
#include <memory>

#include "runtime/cuda_check.h"
#include "kernels/permute.cuh"
#include "kernels/router.cuh"
#include "ops/cuda_ops.h"

namespace mop {

struct MoeState {
  Buffer plan;       // route plan: i32 [ceil(T·K/2048), E]
  Buffer aux;        // aux loss: f32 per-chunk column sums and lse² sums
  Buffer host_plan;  // i32 counts [E] and offsets [E+1] on the device, for host destinations
};

void MoeStateDeleter::operator()(MoeState* s) const {
  delete s;
}

namespace {

// Grows buf to at least `bytes`. After prepare_moe only calls beyond the prepared shapes get here
// (tests run without prepare). The stream is drained first, so no queued kernel still uses the old
// memory; the device is synchronised after, because Buffer zero-fills with a cudaMemset on the
// legacy stream, which our non-blocking stream does not wait for.
void reserve(Buffer& buf, size_t bytes, cudaStream_t stream) {
  if (buf.bytes() >= bytes) return;
  MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  buf = Buffer();
  buf = Buffer(MemKind::Device, bytes);
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
}

MoeState& state(std::unique_ptr<MoeState, MoeStateDeleter>& moe) {
  if (!moe) moe.reset(new MoeState());
  return *moe;
}

// dtype, exact shape, data present; on the device unless host_ok.
void expect(const Tensor& t, const char* name, DType dtype, std::initializer_list<int64_t> dims,
            bool host_ok = false) {
  expect_tensor(t, name, host_ok ? std::nullopt : std::optional<Device>(Device::CUDA), dtype, dims);
}

void check_int(int64_t v, const char* what) {
  MOP_CHECK(v >= 0 && v <= INT_MAX, what, " = ", v, " does not fit the kernels' int sizes");
}

}  // namespace

void CudaOps::prepare_moe(const OpShapes& shapes) {
  if (shapes.experts <= 0) return;  // a dense model
  MoeState& st = state(moe_);
  const int64_t experts = shapes.experts;
  check_int(experts, "experts");
  reserve(st.plan,
          kernels::route_plan_workspace_bytes(shapes.max_tokens * shapes.top_k, int(experts)),
          stream_);
  reserve(st.aux, kernels::moe_aux_loss_workspace_bytes(int(experts)), stream_);
  reserve(st.host_plan, size_t(2 * experts + 1) * sizeof(int32_t), stream_);
}

size_t CudaOps::moe_workspace_bytes() const {
  return moe_ ? moe_->plan.bytes() + moe_->aux.bytes() + moe_->host_plan.bytes() : 0;
}

void CudaOps::router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse,
                         const Tensor& logits, bool renormalize) {
  MOP_CHECK(logits.ndim == 2 && topk_idx.ndim == 2, "router_fwd: logits ", logits.shape_str(),
            " and topk_idx ", topk_idx.shape_str(), " must be [T,E] and [T,K]");
  const int64_t num_tokens = logits.shape[0], num_experts = logits.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(top_k >= 1 && top_k <= num_experts && num_experts <= kernels::kRouterMaxExperts,
            "router_fwd: top_k = ", top_k, " with ", num_experts, " experts (at most ",
            kernels::kRouterMaxExperts, ")");
  check_int(num_tokens, "router_fwd: tokens");
  expect(logits, "router_fwd: logits", DType::F32, {num_tokens, num_experts});
  expect(topk_idx, "router_fwd: topk_idx", DType::I32, {num_tokens, top_k});
  expect(topk_w, "router_fwd: topk_w", DType::F32, {num_tokens, top_k});
  expect(probs, "router_fwd: probs", DType::F32, {num_tokens, num_experts});
  expect(lse, "router_fwd: lse", DType::F32, {num_tokens});
  kernels::launch_router_fwd(topk_idx.ptr<int32_t>(), topk_w.ptr<float>(), probs.ptr<float>(),
                             lse.ptr<float>(), logits.ptr<float>(), int(num_tokens),
                             int(num_experts), int(top_k), renormalize, stream_);
}

void CudaOps::router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs,
                         const Tensor& lse, const Tensor& topk_idx, const Tensor& topk_w,
                         const Tensor& aux_grad, float z_grad_scale, bool renormalize) {
  MOP_CHECK(probs.ndim == 2 && topk_idx.ndim == 2, "router_bwd: probs ", probs.shape_str(),
            " and topk_idx ", topk_idx.shape_str(), " must be [T,E] and [T,K]");
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  const int64_t top_k = topk_idx.shape[1];
  MOP_CHECK(top_k >= 1 && top_k <= num_experts && num_experts <= kernels::kRouterMaxExperts,
            "router_bwd: top_k = ", top_k, " with ", num_experts, " experts (at most ",
            kernels::kRouterMaxExperts, ")");
  check_int(num_tokens, "router_bwd: tokens");
  expect(dlogits, "router_bwd: dlogits", DType::F32, {num_tokens, num_experts});
  expect(dtopk_w, "router_bwd: dtopk_w", DType::F32, {num_tokens, top_k});
  expect(probs, "router_bwd: probs", DType::F32, {num_tokens, num_experts});
  expect(lse, "router_bwd: lse", DType::F32, {num_tokens});
  expect(topk_idx, "router_bwd: topk_idx", DType::I32, {num_tokens, top_k});
  expect(topk_w, "router_bwd: topk_w", DType::F32, {num_tokens, top_k});
  expect(aux_grad, "router_bwd: aux_grad", DType::F32, {num_experts});
  kernels::launch_router_bwd(dlogits.ptr<float>(), dtopk_w.ptr<float>(), probs.ptr<float>(),
                             lse.ptr<float>(), topk_idx.ptr<int32_t>(), topk_w.ptr<float>(),
                             aux_grad.ptr<float>(), z_grad_scale, int(num_tokens), int(num_experts),
                             int(top_k), renormalize, stream_);
}

void CudaOps::moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                           const Tensor& counts, int top_k, float aux_coef, float z_coef) {
  MOP_CHECK(probs.ndim == 2, "moe_aux_loss: probs must be [T,E], is ", probs.shape_str());
  const int64_t num_tokens = probs.shape[0], num_experts = probs.shape[1];
  MOP_CHECK(num_tokens > 0 && top_k >= 1 && top_k <= num_experts, "moe_aux_loss: T = ", num_tokens,
            ", top_k = ", top_k, ", E = ", num_experts);
  check_int(num_tokens, "moe_aux_loss: tokens");
  check_int(num_experts, "moe_aux_loss: experts");
  expect(losses, "moe_aux_loss: losses", DType::F32, {2});
  expect(aux_grad, "moe_aux_loss: aux_grad", DType::F32, {num_experts});
  expect(probs, "moe_aux_loss: probs", DType::F32, {num_tokens, num_experts});
  expect(lse, "moe_aux_loss: lse", DType::F32, {num_tokens});
  expect(counts, "moe_aux_loss: counts", DType::I32, {num_experts});
  MoeState& st = state(moe_);
  reserve(st.aux, kernels::moe_aux_loss_workspace_bytes(int(num_experts)), stream_);
  kernels::launch_moe_aux_loss(losses.ptr<float>(), aux_grad.ptr<float>(), st.aux.data(),
                               probs.ptr<float>(), lse.ptr<float>(), counts.ptr<int32_t>(),
                               int(num_tokens), int(num_experts), top_k, aux_coef, z_coef, stream_);
}

// counts and offsets may be host tensors (grouped GEMM reads host offsets): they are then formed
// on the device, copied back, and the stream is synchronised before returning.
void CudaOps::moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                             const Tensor& topk_idx) {
  MOP_CHECK(topk_idx.ndim == 2 && counts.ndim == 1, "moe_route_plan: topk_idx ",
            topk_idx.shape_str(), " must be [T,K], counts ", counts.shape_str(), " [E]");
  const int64_t num_tokens = topk_idx.shape[0], top_k = topk_idx.shape[1];
  const int64_t num_experts = counts.shape[0], n = num_tokens * top_k;
  MOP_CHECK(top_k >= 1 && num_experts >= 1 && num_experts <= kernels::kPlanMaxExperts,
            "moe_route_plan: top_k = ", top_k, ", E = ", num_experts, " (at most ",
            kernels::kPlanMaxExperts, ")");
  check_int(n, "moe_route_plan: assignments");
  expect(topk_idx, "moe_route_plan: topk_idx", DType::I32, {num_tokens, top_k});
  expect(counts, "moe_route_plan: counts", DType::I32, {num_experts}, /*host_ok=*/true);
  expect(offsets, "moe_route_plan: offsets", DType::I32, {num_experts + 1}, /*host_ok=*/true);
  expect(perm_src, "moe_route_plan: perm_src", DType::I32, {n});
  expect(slot_of, "moe_route_plan: slot_of", DType::I32, {n});
  MoeState& st = state(moe_);
  reserve(st.plan, kernels::route_plan_workspace_bytes(n, int(num_experts)), stream_);
  const bool counts_host = counts.device != Device::CUDA;
  const bool offsets_host = offsets.device != Device::CUDA;
  if (counts_host || offsets_host)
    reserve(st.host_plan, size_t(2 * num_experts + 1) * sizeof(int32_t), stream_);
  int32_t* scratch = static_cast<int32_t*>(st.host_plan.data());
  int32_t* d_counts = counts_host ? scratch : counts.ptr<int32_t>();
  int32_t* d_offsets = offsets_host ? scratch + num_experts : offsets.ptr<int32_t>();
  kernels::launch_moe_route_plan(d_counts, d_offsets, perm_src.ptr<int32_t>(),
                                 slot_of.ptr<int32_t>(), st.plan.data(), topk_idx.ptr<int32_t>(),
                                 int(num_tokens), int(top_k), int(num_experts), stream_);
  if (counts_host)
    MOP_CUDA_CHECK(
        cudaMemcpyAsync(counts.data, d_counts, counts.bytes(), cudaMemcpyDeviceToHost, stream_));
  if (offsets_host)
    MOP_CUDA_CHECK(
        cudaMemcpyAsync(offsets.data, d_offsets, offsets.bytes(), cudaMemcpyDeviceToHost, stream_));
  if (counts_host || offsets_host) synchronize();
}

void CudaOps::moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) {
  MOP_CHECK(x.ndim == 2 && xp.ndim == 2 && perm_src.ndim == 1, "moe_permute_fwd: xp ",
            xp.shape_str(), ", x ", x.shape_str(), ", perm_src ", perm_src.shape_str());
  const int64_t rows = perm_src.shape[0], hidden = x.shape[1];
  check_int(hidden, "moe_permute_fwd: hidden");
  expect(x, "moe_permute_fwd: x", DType::BF16, {x.shape[0], hidden});
  expect(xp, "moe_permute_fwd: xp", DType::BF16, {rows, hidden});
  expect(perm_src, "moe_permute_fwd: perm_src", DType::I32, {rows});
  kernels::launch_moe_permute_fwd(xp.ptr<bf16>(), x.ptr<bf16>(), perm_src.ptr<int32_t>(), rows,
                                  int(hidden), stream_);
}

void CudaOps::moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                              bool accumulate) {
  MOP_CHECK(dx.ndim == 2 && top_k >= 1, "moe_permute_bwd: dx ", dx.shape_str(), ", top_k ", top_k);
  const int64_t num_tokens = dx.shape[0], hidden = dx.shape[1];
  check_int(num_tokens * top_k, "moe_permute_bwd: rows");
  check_int(hidden, "moe_permute_bwd: hidden");
  expect(dx, "moe_permute_bwd: dx", DType::BF16, {num_tokens, hidden});
  expect(dxp, "moe_permute_bwd: dxp", DType::BF16, {num_tokens * top_k, hidden});
  expect(slot_of, "moe_permute_bwd: slot_of", DType::I32, {num_tokens * top_k});
  kernels::launch_moe_permute_bwd(dx.ptr<bf16>(), dxp.ptr<bf16>(), slot_of.ptr<int32_t>(),
                                  int(num_tokens), top_k, int(hidden), accumulate, stream_);
}

void CudaOps::moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of,
                                const Tensor& topk_w, bool accumulate) {
  MOP_CHECK(y.ndim == 2 && topk_w.ndim == 2, "moe_unpermute_fwd: y ", y.shape_str(), " and topk_w ",
            topk_w.shape_str(), " must be [T,H] and [T,K]");
  const int64_t num_tokens = y.shape[0], hidden = y.shape[1], top_k = topk_w.shape[1];
  check_int(num_tokens * top_k, "moe_unpermute_fwd: rows");
  check_int(hidden, "moe_unpermute_fwd: hidden");
  expect(y, "moe_unpermute_fwd: y", DType::BF16, {num_tokens, hidden});
  expect(yp, "moe_unpermute_fwd: yp", DType::BF16, {num_tokens * top_k, hidden});
  expect(topk_w, "moe_unpermute_fwd: topk_w", DType::F32, {num_tokens, top_k});
  expect(slot_of, "moe_unpermute_fwd: slot_of", DType::I32, {num_tokens * top_k});
  kernels::launch_moe_unpermute_fwd(y.ptr<bf16>(), yp.ptr<bf16>(), slot_of.ptr<int32_t>(),
                                    topk_w.ptr<float>(), int(num_tokens), int(top_k), int(hidden),
                                    accumulate, stream_);
}

void CudaOps::moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                                const Tensor& slot_of, const Tensor& topk_w) {
  MOP_CHECK(dy.ndim == 2 && topk_w.ndim == 2, "moe_unpermute_bwd: dy ", dy.shape_str(),
            " and topk_w ", topk_w.shape_str(), " must be [T,H] and [T,K]");
  const int64_t num_tokens = dy.shape[0], hidden = dy.shape[1], top_k = topk_w.shape[1];
  check_int(num_tokens * top_k, "moe_unpermute_bwd: rows");
  check_int(hidden, "moe_unpermute_bwd: hidden");
  expect(dy, "moe_unpermute_bwd: dy", DType::BF16, {num_tokens, hidden});
  expect(yp, "moe_unpermute_bwd: yp", DType::BF16, {num_tokens * top_k, hidden});
  expect(dyp, "moe_unpermute_bwd: dyp", DType::BF16, {num_tokens * top_k, hidden});
  expect(topk_w, "moe_unpermute_bwd: topk_w", DType::F32, {num_tokens, top_k});
  expect(dtopk_w, "moe_unpermute_bwd: dtopk_w", DType::F32, {num_tokens, top_k});
  expect(slot_of, "moe_unpermute_bwd: slot_of", DType::I32, {num_tokens * top_k});
  kernels::launch_moe_unpermute_bwd(dyp.ptr<bf16>(), dtopk_w.ptr<float>(), dy.ptr<bf16>(),
                                    yp.ptr<bf16>(), slot_of.ptr<int32_t>(), topk_w.ptr<float>(),
                                    int(num_tokens), int(top_k), int(hidden), stream_);
}

}  // namespace mop
