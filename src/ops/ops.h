// The op interface: every computation of the model's step, forward and backward. The CPU reference
// (cpu_ops.cpp, plain loops, float and double) and the CUDA backend (kernels/) implement it; model
// code is written once against it.
//
// Conventions
//   Shapes: T tokens of a micro-batch (B sequences × S positions, row t = b·S + s), H hidden,
//   Nq / Nkv query / key-value heads, D head dim, E experts, K top-k, F FFN width, V vocabulary,
//   R rows of an expert-ordered buffer. All tensors are contiguous row-major views.
//   Dtypes: "compute" tensors (activations, weights and their gradients) share one dtype per run:
//   F32 or F64 on the CPU, BF16 on the GPU. "acc" tensors (norm statistics, router logits and
//   probabilities, losses) are acc_dtype(compute): F64 in fp64 runs, F32 otherwise. Indices are I32.
//   Outputs come first, then inputs, then sizes/scalars. Unless a flag says "accumulate", outputs
//   are overwritten; weight gradients (dw, dtable) are always accumulated (+=), so micro-batches
//   add up without extra copies.
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>

#include "core/tensor.h"
#include "runtime/runtime.h"

namespace mop {

// The argument check the backends share: `t` is on `device` (any device when nullopt), has
// `dtype` and exactly the shape `dims`, and has data when it has elements; otherwise an error
// naming `name` and what was expected.
void expect_tensor(const Tensor& t, const char* name, std::optional<Device> device, DType dtype,
                   std::initializer_list<int64_t> dims);

struct AdamWArgs {
  float lr = 0;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0;
  float grad_scale = 1;    // gradients are multiplied by this first (clipping)
  float bias_correction1 = 1;  // 1 - beta1^step
  float bias_correction2 = 1;  // 1 - beta2^step
};

// The largest shapes a run passes to the ops (tokens, sequences, heads, …), so a backend can build
// its plans and size its workspaces once, before the first step.
struct OpShapes {
  int64_t max_tokens = 0;  // T of the largest micro-batch
  int64_t batch = 0, seq = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t hidden = 0, experts = 0, top_k = 0, expert_ffn = 0, vocab = 0;
  int64_t lm_head_chunk = 0;
  // Ring attention (parallel/ring_attention.h) also runs the non-causal attention of this shape.
  bool attention_non_causal = false;
};

class Ops {
 public:
  virtual ~Ops() = default;
  virtual Device device() const = 0;
  // Waits for all queued work (the CPU backend runs synchronously).
  virtual void synchronize() {}
  // The stream the ops are issued on, in order (runtime.h): the null stream on the CPU. Other
  // streams order themselves against it through events.
  virtual Stream stream() const { return Stream(); }
  // Builds plans and allocates the backend's internal workspaces for calls up to `shapes`; called
  // before the first step. Calls with other shapes (generation) may build more plans lazily.
  virtual void prepare(const OpShapes& shapes) {}
  // Bytes the backend's internal workspaces hold (part of the planned memory).
  virtual size_t workspace_bytes() const { return 0; }

  // ---- elementwise and memory ---------------------------------------------------------------
  virtual void fill(Tensor x, double value) = 0;
  // dst = src elementwise with dtype conversion (bf16 rounding is nearest-even); same numel. A
  // copy to or from host memory returns once the host side may be read or reused.
  virtual void copy(Tensor dst, const Tensor& src) = 0;
  // out = a + b (out may alias a or b); same shapes and dtypes.
  virtual void add(Tensor out, const Tensor& a, const Tensor& b) = 0;
  // out[0] = Σ x² over all elements (acc dtype scalar; x any float dtype).
  virtual void sumsq(Tensor out, const Tensor& x) = 0;
  // out[0] = Σ x (acc dtype scalar).
  virtual void sum(Tensor out, const Tensor& x) = 0;

  // ---- dense GEMM ----------------------------------------------------------------------------
  // c[M,N] = alpha · op(a) · op(b) + beta · c, op(x) = xᵀ when trans. a is [M,K] (or [K,M] when
  // trans_a), b is [K,N] (or [N,K] when trans_b). a and b share the compute dtype; c is compute or
  // acc dtype (router logits are produced in fp32). Accumulates in acc precision.
  virtual void gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                    float alpha, float beta) = 0;

  // ---- grouped GEMM over experts ---------------------------------------------------------------
  // Rows of x/y are grouped by expert: rows [offsets[e], offsets[e+1]) belong to expert e.
  // offsets is I32 [E+1] in host memory (offsets[0] = 0, offsets[E] = R ≤ rows of x and y);
  // rows past R are not touched. w is [E,N,K].
  virtual void grouped_gemm_fwd(Tensor y /*[R,N]*/, const Tensor& x /*[R,K]*/, const Tensor& w,
                                const Tensor& offsets) = 0;
  // dx = dy · w_e
  virtual void grouped_gemm_bwd_data(Tensor dx /*[R,K]*/, const Tensor& dy /*[R,N]*/,
                                     const Tensor& w, const Tensor& offsets) = 0;
  // dw_e += dy_eᵀ · x_e; with accumulate false dw_e = dy_eᵀ · x_e, and 0 for an expert with no
  // rows (the first micro-batch of a step writes the experts' gradients: no zeroing, no fp32
  // read). Either way the sum over rows starts from dw_e's old value or from +0 and runs in the
  // same order, so writing equals adding to zeros bit for bit on the CPU.
  virtual void grouped_gemm_bwd_weight(Tensor dw /*[E,N,K]*/, const Tensor& dy /*[R,N]*/,
                                       const Tensor& x /*[R,K]*/, const Tensor& offsets,
                                       bool accumulate = true) = 0;

  // ---- embedding -----------------------------------------------------------------------------
  // out[t] = table[ids[t]]; ids I32 [T], table [V,H], out [T,H].
  virtual void embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) = 0;
  // dtable[ids[t]] += dout[t].
  virtual void embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) = 0;

  // ---- RMSNorm over the last dim -------------------------------------------------------------
  // y = x · rstd · w, rstd = 1/sqrt(mean(x²) + eps). x,y [N,C]; w [C]; rstd acc [N].
  // Per-head q/k norm is the same op with N = T·heads, C = D.
  virtual void rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) = 0;
  // dx (+)= ∂/∂x, dw += ∂/∂w.
  virtual void rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x,
                           const Tensor& w, const Tensor& rstd, bool accumulate_dx) = 0;

  // ---- rotary position embedding (in place), x [T,heads,D], pos I32 [T] ----------------------
  // Pairs (i, i + D/2) rotated by pos·theta^(-2i/D) ("rotate half" layout of Llama/Qwen).
  // Angles are formed in fp32 as Hugging Face does: inv_freq = 1/theta^(2i/D) in fp32, then
  // angle = float(pos) · inv_freq in fp32; cos/sin of that fp32 angle.
  virtual void rope_fwd(Tensor x, const Tensor& pos, float theta) = 0;
  virtual void rope_bwd(Tensor dx, const Tensor& pos, float theta) = 0;  // inverse rotation

  // ---- GQA attention over `batch` sequences ---------------------------------------------------
  // q [T,Nq,D], k/v [T,Nkv,D], out [T,Nq,D], lse acc [batch,Nq,S] (log-sum-exp of the scaled
  // scores, natural log). Query head h uses kv head h / (Nq/Nkv). causal: query s of a sequence
  // sees its keys 0..s; otherwise all S keys of its sequence (ring attention's off-diagonal blocks:
  // c queries against c keys of another chunk, see parallel/ring_attention.h).
  virtual void attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, int batch, float scale, bool causal) = 0;
  // dq, dk, dv are overwritten. out and lse may be those of a larger attention the block is part
  // of (ring attention passes the merged output and its lse): the softmax is recomputed as
  // exp(scores − lse), so the result is this block's exact share of that attention's gradient.
  // (Not at S = 1 on the GPU: that path takes out and lse to be the call's own.)
  virtual void attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out,
                             const Tensor& lse, int batch, float scale, bool causal) = 0;
  // Merges a partial attention result into an accumulator (ring attention): with
  // lse' = log(exp(lse_acc) + exp(lse)),
  //   out_acc = out_acc·exp(lse_acc − lse') + o·exp(lse − lse'),  lse_acc = lse'.
  // out_acc acc [T,Nq,D], lse_acc acc [batch,Nq,S] (T = batch·S; the layouts attention_fwd's out
  // and lse have); o [T,Nq,D] compute, lse acc [batch,Nq,S]. lse_acc = −inf marks an empty
  // accumulator (out_acc is then ignored and becomes o); lse = −inf contributes nothing.
  virtual void attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                               int batch) = 0;

  // ---- SwiGLU: h = silu(g) · u with gu = [g | u] ----------------------------------------------
  virtual void swiglu_fwd(Tensor h /*[M,F]*/, const Tensor& gu /*[M,2F]*/) = 0;
  virtual void swiglu_bwd(Tensor dgu /*[M,2F]*/, const Tensor& dh /*[M,F]*/, const Tensor& gu) = 0;

  // ---- router --------------------------------------------------------------------------------
  // probs = softmax(logits) (acc, [T,E]); lse[t] = logsumexp(logits[t]); topk_idx/topk_w [T,K]
  // are the K largest probabilities in descending order (ties: lower expert index first);
  // weights are renormalised to sum 1 when `renormalize`.
  virtual void router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse,
                          const Tensor& logits, bool renormalize) = 0;
  // dlogits[T,E] (acc) from: dtopk_w [T,K] (through top-k and renormalisation), a per-expert
  // gradient on the probabilities shared by every token (aux_grad [E], from the load-balancing
  // loss), and z_grad_scale · ∂(Σ_t lse_t²)/∂logits (router z-loss).
  virtual void router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs,
                          const Tensor& lse, const Tensor& topk_idx, const Tensor& topk_w,
                          const Tensor& aux_grad, float z_grad_scale, bool renormalize) = 0;
  // Load-balancing loss of one MoE layer over its T tokens (Switch/Qwen form):
  //   aux = E/(T·K) · Σ_e counts[e] · (1/T)·Σ_t probs[t,e],    z = (1/T)·Σ_t lse[t]²
  // losses[0] += aux_coef·aux, losses[1] += z_coef·z (acc [2]);
  // aux_grad[e] = aux_coef · E · counts[e] / (T²·K) = ∂(aux_coef·aux)/∂probs[t,e].
  // counts is I32 [E] on this op's device.
  virtual void moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                            const Tensor& counts, int top_k, float aux_coef, float z_coef) = 0;

  // ---- token permutation into expert-contiguous order -----------------------------------------
  // From topk_idx [T,K]: counts [E], offsets [E+1] (exclusive prefix sum), perm_src [T·K] (row r
  // of the expert-ordered buffer holds token perm_src[r]) and slot_of [T·K] (assignment t·K+k sits
  // at row slot_of[t·K+k]). Within an expert rows are ordered by (t, k): deterministic.
  virtual void moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                              const Tensor& topk_idx) = 0;
  // xp[r] = x[perm_src[r]]; x [T,H], xp [T·K,H].
  virtual void moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) = 0;
  // dx[t] (+)= Σ_k dxp[slot_of[t·K+k]].
  virtual void moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                               bool accumulate) = 0;
  // y[t] (+)= Σ_k topk_w[t,k] · yp[slot_of[t·K+k]]; yp [T·K,H], y [T,H].
  virtual void moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of,
                                 const Tensor& topk_w, bool accumulate) = 0;
  // dyp[slot_of[t·K+k]] = topk_w[t,k]·dy[t];  dtopk_w[t,k] = ⟨dy[t], yp[slot_of[t·K+k]]⟩.
  virtual void moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                                 const Tensor& slot_of, const Tensor& topk_w) = 0;

  // ---- fused LM head + cross-entropy, chunked over tokens --------------------------------------
  // For each token: logits = x[t] · wᵀ (w [V,H]); lse[t] = logsumexp(logits);
  // loss[t] = lse[t] − logits[targets[t]], or 0 where targets[t] < 0 (masked). The full [T,V]
  // logits never exist: `workspace` (acc [C,V]) holds one chunk of C tokens at a time.
  virtual void lmhead_ce_fwd(Tensor loss /*acc [T]*/, Tensor lse /*acc [T]*/, const Tensor& x,
                             const Tensor& w, const Tensor& targets, Tensor workspace) = 0;
  // Gradient of grad_scale · Σ_t loss[t]: dx [T,H] (overwritten), dw [V,H] (+=). Recomputes each
  // chunk's logits from x and w and the saved lse.
  virtual void lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
                             const Tensor& targets, const Tensor& lse, float grad_scale,
                             Tensor workspace) = 0;
  // Both at once, for training: a chunk's gradient is known as soon as its lse is, so each
  // chunk's logits are computed once and turned into dx and dw (three passes over the vocabulary
  // instead of four). The same loss, lse, dx and dw as lmhead_ce_fwd then lmhead_ce_bwd, bit for
  // bit; backends may fuse (this default runs the two).
  virtual void lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                                 const Tensor& w, const Tensor& targets, float grad_scale,
                                 Tensor workspace) {
    lmhead_ce_fwd(loss, lse, x, w, targets, workspace);
    lmhead_ce_bwd(dx, dw, x, w, targets, lse, grad_scale, workspace);
  }

  // ---- optimizer -----------------------------------------------------------------------------
  // AdamW (decoupled weight decay, torch.optim.AdamW's form) on fp32 param/m/v; grad any float.
  //   g = grad·grad_scale; m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·g²
  //   param = param·(1 − lr·wd) − (lr/bc1) · m / (sqrt(v)/sqrt(bc2) + eps)
  virtual void adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                          const AdamWArgs& args) = 0;
  // adamw_step, then weights = param converted to weights' dtype (the compute weights); backends
  // may fuse the two into one pass.
  virtual void adamw_step_cast(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                               const AdamWArgs& args, Tensor weights) {
    adamw_step(param, m, v, grad, args);
    copy(weights, param);
  }
};

// The CPU reference backend (always available).
std::unique_ptr<Ops> make_cpu_ops();
// The CUDA backend (binaries built with MOP_CUDA; see cuda_ops.h) on GPU local_rank % #GPUs of
// this host: one GPU per local rank.
std::unique_ptr<Ops> make_cuda_ops(int local_rank);
// The backend of `device`: make_cpu_ops() or make_cuda_ops(local_rank); a CUDA device in a binary
// built without CUDA is a user error.
std::unique_ptr<Ops> make_ops(Device device, int local_rank = 0);

}  // namespace mop
