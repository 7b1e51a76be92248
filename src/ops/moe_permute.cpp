// Front of the MoE token permutation: the route plan, permute / unpermute and their backwards —
// the checks, then the backend's hooks (cpu/moe_permute.cpp, cuda/moe_permute.cpp,
// kernels/moe_permute.cu). Index contents are range-checked by the CPU backend, which reads them.
#include "core/error.h"
#include "ops/ops.h"

namespace mop {
namespace {

// [T,H] token rows and [T·K,H] expert-ordered rows of one compute dtype; returns T.
int64_t check_rows(const Ops& ops, const Tensor& tok, const Tensor& perm, int64_t top_k,
                   const char* op) {
  MOP_CHECK(tok.ndim == 2, op, ": token rows must be [T,H], are ", tok.shape_str());
  const DType dt = ops.compute_dtype(tok, op);
  const int64_t num_tokens = tok.shape[0], hidden = tok.shape[1];
  ops.expect(tok, "moe permutation: token rows [T,H]", dt, {num_tokens, hidden});
  ops.expect(perm, "moe permutation: expert-ordered rows [T·K,H]", dt, {num_tokens * top_k, hidden});
  return num_tokens;
}

}  // namespace

void Ops::moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                         const Tensor& topk_idx) {
  MOP_CHECK(topk_idx.ndim == 2 && counts.ndim == 1, "moe_route_plan: topk_idx ",
            topk_idx.shape_str(), " must be [T,K], counts ", counts.shape_str(), " [E]");
  const int64_t num_tokens = topk_idx.shape[0], top_k = topk_idx.shape[1];
  const int64_t num_experts = counts.shape[0], n = num_tokens * top_k;
  MOP_CHECK(top_k >= 1 && num_experts >= 1, "moe_route_plan: top_k = ", top_k, ", E = ",
            num_experts);
  expect(topk_idx, "moe_route_plan: topk_idx", DType::I32, {num_tokens, top_k});
  expect(counts, "moe_route_plan: counts", DType::I32, {num_experts}, /*host_ok=*/true);
  expect(offsets, "moe_route_plan: offsets", DType::I32, {num_experts + 1}, /*host_ok=*/true);
  expect(perm_src, "moe_route_plan: perm_src", DType::I32, {n});
  expect(slot_of, "moe_route_plan: slot_of", DType::I32, {n});
  run(OpId::moe_route_plan, &OpsBackend::moe_route_plan, counts, offsets, perm_src, slot_of,
      topk_idx);
}

void Ops::moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) {
  MOP_CHECK(x.ndim == 2 && xp.ndim == 2 && perm_src.ndim == 1, "moe_permute_fwd: xp ",
            xp.shape_str(), ", x ", x.shape_str(), ", perm_src ", perm_src.shape_str());
  const DType dt = compute_dtype(x, "moe_permute_fwd: x");
  const int64_t rows = perm_src.shape[0], hidden = x.shape[1];
  expect(x, "moe_permute_fwd: x", dt, {x.shape[0], hidden});
  expect(xp, "moe_permute_fwd: xp", dt, {rows, hidden});
  expect(perm_src, "moe_permute_fwd: perm_src", DType::I32, {rows});
  run(OpId::moe_permute_fwd, &OpsBackend::moe_permute_fwd, xp, x, perm_src);
}

void Ops::moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                          bool accumulate) {
  MOP_CHECK(top_k >= 1, "moe_permute_bwd: top_k = ", top_k);
  const int64_t num_tokens = check_rows(*this, dx, dxp, top_k, "moe_permute_bwd");
  expect(slot_of, "moe_permute_bwd: slot_of", DType::I32, {num_tokens * top_k});
  run(OpId::moe_permute_bwd, &OpsBackend::moe_permute_bwd, dx, dxp, slot_of, top_k, accumulate);
}

void Ops::moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of,
                            const Tensor& topk_w, bool accumulate) {
  MOP_CHECK(topk_w.ndim == 2, "moe_unpermute_fwd: topk_w must be [T,K], is ", topk_w.shape_str());
  const int64_t top_k = topk_w.shape[1];
  const int64_t num_tokens = check_rows(*this, y, yp, top_k, "moe_unpermute_fwd");
  expect(topk_w, "moe_unpermute_fwd: topk_w", acc_dtype(y.dtype), {num_tokens, top_k});
  expect(slot_of, "moe_unpermute_fwd: slot_of", DType::I32, {num_tokens * top_k});
  run(OpId::moe_unpermute_fwd, &OpsBackend::moe_unpermute_fwd, y, yp, slot_of, topk_w, accumulate);
}

void Ops::moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                            const Tensor& slot_of, const Tensor& topk_w) {
  MOP_CHECK(topk_w.ndim == 2, "moe_unpermute_bwd: topk_w must be [T,K], is ", topk_w.shape_str());
  const int64_t top_k = topk_w.shape[1];
  const int64_t num_tokens = check_rows(*this, dy, yp, top_k, "moe_unpermute_bwd");
  const int64_t hidden = dy.shape[1];
  expect(dyp, "moe_unpermute_bwd: dyp", dy.dtype, {num_tokens * top_k, hidden});
  expect(topk_w, "moe_unpermute_bwd: topk_w", acc_dtype(dy.dtype), {num_tokens, top_k});
  expect(dtopk_w, "moe_unpermute_bwd: dtopk_w", acc_dtype(dy.dtype), {num_tokens, top_k});
  expect(slot_of, "moe_unpermute_bwd: slot_of", DType::I32, {num_tokens * top_k});
  run(OpId::moe_unpermute_bwd, &OpsBackend::moe_unpermute_bwd, dyp, dtopk_w, dy, yp, slot_of,
      topk_w);
}

}  // namespace mop
