// CUDA backend, moe_permute stem: the route plan (counting sort of assignments by expert) and the
// token permutation into expert order and back, with their backwards (kernels/moe_permute.cu).
#include "kernels/moe_permute.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/moe_state.h"

namespace mop {

// counts and offsets may be host tensors (grouped GEMM reads host offsets): they are then formed
// on the device, copied back, and the stream is synchronised before returning.
void CudaBackend::moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                             const Tensor& topk_idx) {
  const int64_t num_tokens = topk_idx.shape[0], top_k = topk_idx.shape[1];
  const int64_t num_experts = counts.shape[0], n = num_tokens * top_k;
  MOP_CHECK(num_experts <= kernels::kPlanMaxExperts, "moe_route_plan: ", num_experts,
            " experts (at most ", kernels::kPlanMaxExperts, ")");
  check_int(n, "moe_route_plan: assignments");
  MoeState& st = moe_state();
  reserve_moe(st.plan, kernels::route_plan_workspace_bytes(n, int(num_experts)), stream_);
  const bool counts_host = counts.device != Device::CUDA;
  const bool offsets_host = offsets.device != Device::CUDA;
  if (counts_host || offsets_host)
    reserve_moe(st.host_plan, size_t(2 * num_experts + 1) * sizeof(int32_t), stream_);
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

void CudaBackend::moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) {
  const int64_t rows = perm_src.shape[0], hidden = x.shape[1];
  check_int(hidden, "moe_permute_fwd: hidden");
  kernels::launch_moe_permute_fwd(xp.ptr<bf16>(), x.ptr<bf16>(), perm_src.ptr<int32_t>(), rows,
                                  int(hidden), stream_);
}

void CudaBackend::moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                              bool accumulate) {
  const int64_t num_tokens = dx.shape[0], hidden = dx.shape[1];
  check_int(num_tokens * top_k, "moe_permute_bwd: rows");
  check_int(hidden, "moe_permute_bwd: hidden");
  kernels::launch_moe_permute_bwd(dx.ptr<bf16>(), dxp.ptr<bf16>(), slot_of.ptr<int32_t>(),
                                  int(num_tokens), top_k, int(hidden), accumulate, stream_);
}

void CudaBackend::moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of,
                                const Tensor& topk_w, bool accumulate) {
  const int64_t num_tokens = y.shape[0], hidden = y.shape[1], top_k = topk_w.shape[1];
  check_int(num_tokens * top_k, "moe_unpermute_fwd: rows");
  check_int(hidden, "moe_unpermute_fwd: hidden");
  kernels::launch_moe_unpermute_fwd(y.ptr<bf16>(), yp.ptr<bf16>(), slot_of.ptr<int32_t>(),
                                    topk_w.ptr<float>(), int(num_tokens), int(top_k), int(hidden),
                                    accumulate, stream_);
}

void CudaBackend::moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                                const Tensor& slot_of, const Tensor& topk_w) {
  const int64_t num_tokens = dy.shape[0], hidden = dy.shape[1], top_k = topk_w.shape[1];
  check_int(num_tokens * top_k, "moe_unpermute_bwd: rows");
  check_int(hidden, "moe_unpermute_bwd: hidden");
  kernels::launch_moe_unpermute_bwd(dyp.ptr<bf16>(), dtopk_w.ptr<float>(), dy.ptr<bf16>(),
                                    yp.ptr<bf16>(), slot_of.ptr<int32_t>(), topk_w.ptr<float>(),
                                    int(num_tokens), int(top_k), int(hidden), stream_);
}

}  // namespace mop
