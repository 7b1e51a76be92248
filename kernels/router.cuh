// MoE router kernels: softmax → top-k → optional renormalisation (one warp per token), its
// backward through renormalisation and softmax (plus the load-balancing and z-loss gradients),
// and the layer's load-balancing / z-loss as a deterministic two-stage column reduction.
// All tensors are fp32 except topk_idx and counts (int32); semantics are ops.h's and the CPU
// reference's (src/ops/cpu_router.cpp). Host-callable; no device code visible to .cpp files.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mop::kernels {

// One warp holds a token's E probabilities in registers, at most 32 per lane (the permutation's
// kPlanMaxExperts).
constexpr int kRouterMaxExperts = 1024;

// probs [T,E] = softmax(logits [T,E]); lse [T]; topk_idx / topk_w [T,K]: the K largest
// probabilities in descending order, equal probabilities → lower expert index first; weights
// divided by their sum when renormalize. 1 ≤ K ≤ E ≤ kRouterMaxExperts.
void launch_router_fwd(int32_t* topk_idx, float* topk_w, float* probs, float* lse,
                       const float* logits, int num_tokens, int num_experts, int top_k,
                       bool renormalize, cudaStream_t stream);

// dlogits [T,E] from dtopk_w [T,K], the saved probs/lse/topk_idx/topk_w, aux_grad [E] (added to
// ∂L/∂probs of every token) and z_grad_scale (∂(z_grad_scale·Σ lse²)/∂logits).
void launch_router_bwd(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                       const int32_t* topk_idx, const float* topk_w, const float* aux_grad,
                       float z_grad_scale, int num_tokens, int num_experts, int top_k,
                       bool renormalize, cudaStream_t stream);

// Bytes of the aux-loss workspace for E experts (per-chunk column sums; independent of T).
size_t moe_aux_loss_workspace_bytes(int num_experts);

// losses [2] += {aux_coef·aux, z_coef·z}; aux_grad [E] = aux_coef·E·counts[e]/(T²·K), from probs
// [T,E], lse [T] and device counts [E]. workspace: moe_aux_loss_workspace_bytes(E), 16-aligned.
void launch_moe_aux_loss(float* losses, float* aux_grad, void* workspace, const float* probs,
                         const float* lse, const int32_t* counts, int num_tokens, int num_experts,
                         int top_k, float aux_coef, float z_coef, cudaStream_t stream);

}  // namespace mop::kernels
