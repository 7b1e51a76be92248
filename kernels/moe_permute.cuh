// MoE token permutation kernels: the route plan (a stable counting sort of the T·K token→expert
// assignments by expert) and the moves of bf16 token rows into expert-contiguous order and back,
// with their backwards. Semantics are ops.h's and the CPU reference's (src/ops/cpu/moe_permute.cpp):
// sums over a token's K assignments run in k order in fp32 and are rounded to bf16 once.
// Host-callable; no device code visible to .cpp files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace mop::kernels {

// The route plan keeps one warp's running row per expert in shared memory (8 warps × E ints).
constexpr int kPlanMaxExperts = 1024;
// permute_bwd / unpermute_fwd stage a token's K slots and weights in shared memory.
constexpr int kPermuteMaxTopK = 512;

// Bytes of the route plan's workspace for n = T·K assignments and E experts: one int per (block
// of 2048 assignments, expert).
size_t route_plan_workspace_bytes(int64_t num_assignments, int num_experts);

// counts [E], offsets [E+1] (exclusive prefix sum; offsets[E] = T·K), perm_src [T·K] (token of
// each expert-ordered row), slot_of [T·K] (row of assignment t·K+k), from topk_idx [T,K]. Rows of
// an expert are ordered by assignment index: exact and deterministic. Assignments whose expert lies
// outside [0, E) are dropped (the rows they would fill are left unwritten). All pointers are device
// memory; workspace holds route_plan_workspace_bytes(T·K, E).
void launch_moe_route_plan(int32_t* counts, int32_t* offsets, int32_t* perm_src, int32_t* slot_of,
                           void* workspace, const int32_t* topk_idx, int num_tokens, int top_k,
                           int num_experts, cudaStream_t stream);

// xp[r] = x[perm_src[r]]; x [T,H], xp [R,H].
void launch_moe_permute_fwd(bf16* xp, const bf16* x, const int32_t* perm_src, int64_t rows,
                            int hidden, cudaStream_t stream);

// dx[t] (+)= Σ_k dxp[slot_of[t·K+k]]; dx [T,H], dxp [T·K,H].
void launch_moe_permute_bwd(bf16* dx, const bf16* dxp, const int32_t* slot_of, int num_tokens,
                            int top_k, int hidden, bool accumulate, cudaStream_t stream);

// y[t] (+)= Σ_k topk_w[t,k]·yp[slot_of[t·K+k]]; y [T,H], yp [T·K,H], topk_w fp32 [T,K].
void launch_moe_unpermute_fwd(bf16* y, const bf16* yp, const int32_t* slot_of, const float* topk_w,
                              int num_tokens, int top_k, int hidden, bool accumulate,
                              cudaStream_t stream);

// dyp[slot_of[t·K+k]] = topk_w[t,k]·dy[t]; dtopk_w[t,k] = ⟨dy[t], yp[slot_of[t·K+k]]⟩ (fp32).
void launch_moe_unpermute_bwd(bf16* dyp, float* dtopk_w, const bf16* dy, const bf16* yp,
                              const int32_t* slot_of, const float* topk_w, int num_tokens,
                              int top_k, int hidden, cudaStream_t stream);

}  // namespace mop::kernels
