// GQA flash attention (causal, or full for ring attention's blocks) through cuDNN's fused SDPA
// (frontend graph API): one forward and one backward graph per shape and mask, built on first
// request and cached with its workspace size. Tensors are the op interface's BSHD rows
// ([T,heads,D] bf16, t = b·S + s) described to cuDNN as [B,H,S,D] with strides; lse is cuDNN's
// fp32 Stats ([B,Nq,S], natural-log log-sum-exp of the scaled scores).
// Only this header's .cpp includes the (large) frontend headers.
#pragma once

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>

namespace mop {

// One attention problem: `batch` sequences of `seq` tokens each, causal or full (every query sees
// all `seq` keys of its sequence). The mask is part of the plan key.
struct AttentionShape {
  int64_t batch = 0, seq = 0, num_q_heads = 0, num_kv_heads = 0, head_dim = 0;
  bool causal = true;
  bool operator==(const AttentionShape&) const = default;
  std::string str() const;  // "B=2 S=37 Nq=4 Nkv=2 D=64 causal", for messages
};

// Device pointers of one call. The scale is passed by value at execution, so it is not part of a
// plan's key (prepare() knows the shapes, not the scale).
struct AttentionFwdArgs {
  void* out;              // bf16 [T,Nq,D]
  float* lse;             // fp32 [B,Nq,S]
  const void *q, *k, *v;  // bf16 [T,Nq,D], [T,Nkv,D], [T,Nkv,D]
  float scale;
};
struct AttentionBwdArgs {
  void *dq, *dk, *dv;  // bf16, shaped like q, k, v
  const void *dout, *q, *k, *v, *out;
  const float* lse;
  float scale;
};

enum class AttentionPass : uint8_t { Forward, Backward };

struct AttentionPlan;  // a built cuDNN graph (opaque outside the .cpp)

class CudnnAttention {
 public:
  // deterministic_bwd selects cuDNN's deterministic backward (see the .cpp for its cost).
  CudnnAttention(cudaStream_t stream, bool deterministic_bwd);
  ~CudnnAttention();
  CudnnAttention(const CudnnAttention&) = delete;
  CudnnAttention& operator=(const CudnnAttention&) = delete;

  // The plan of `pass` for `shape`, built on the first request (host work, ~0.1–1 s). A shape cuDNN
  // cannot run raises UserError naming it.
  AttentionPlan& plan(AttentionPass pass, const AttentionShape& shape);
  // Device workspace bytes the plan needs at execution.
  static size_t workspace_bytes(const AttentionPlan& plan);

  // Enqueue on the stream; `workspace` holds at least workspace_bytes(plan) bytes.
  void run_fwd(AttentionPlan& plan, const AttentionFwdArgs& args, void* workspace);
  void run_bwd(AttentionPlan& plan, const AttentionBwdArgs& args, void* workspace);

  bool deterministic_bwd() const { return deterministic_bwd_; }

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
  bool deterministic_bwd_;
};

}  // namespace mop
