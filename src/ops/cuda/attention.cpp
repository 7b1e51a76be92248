// CUDA backend, attention stem: GQA attention (causal or full) forward and backward through cuDNN's
// fused flash attention (attention_cudnn.h; one-token sequences through attention_len1.h). Plans are
// built per shape (B, S, Nq, Nkv, D, mask) in prepare_attention or at the first call with a new
// shape, and one device workspace, sized to the largest plan, serves them all. lse is cuDNN's
// Stats, written in place: fp32 [B,Nq,S], natural-log log-sum-exp of the scaled, masked scores.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <spdlog/spdlog.h>

#include "runtime/cuda_check.h"
#include "ops/cuda/attention_cudnn.h"
#include "ops/cuda/attention_len1.h"
#include "ops/cuda/backend.h"

namespace mop {

// Set to 1 to use cuDNN's deterministic backward (bitwise-reproducible dq at the cost of a
// B·Nq·S²·2-byte workspace; see attention_cudnn.cpp). Read when a CudaBackend first needs
// attention. TODO(config): a config key instead, once the op interface can carry it.
constexpr const char* kDeterministicEnv = "MOP_ATTN_DETERMINISTIC";

struct AttentionState {
  AttentionState(cudaStream_t stream, bool deterministic) : cudnn(stream, deterministic) {}
  CudnnAttention cudnn;
  std::unique_ptr<SingleTokenAttention> single;  // created at the first S = 1 call
  Buffer workspace;  // device; the largest workspace of the plans built so far
};

void AttentionStateDeleter::operator()(AttentionState* s) const {
  delete s;
}

namespace {

bool deterministic_from_env() {
  const char* v = std::getenv(kDeterministicEnv);
  return v && std::strcmp(v, "1") == 0;
}

SingleTokenAttention& single_of(AttentionState& st, cudaStream_t stream) {
  if (!st.single) st.single = std::make_unique<SingleTokenAttention>(stream);
  return *st.single;
}

// Grows the workspace to `bytes`. This happens in prepare or at the first call with a new shape,
// never in a steady step loop. Work already queued may still use the old buffer, so the stream is
// drained before it is freed; the new buffer's zero fill runs on the legacy stream, which our
// non-blocking stream does not wait for, so the device is drained after it too.
void reserve_workspace(AttentionState& st, size_t bytes, cudaStream_t stream) {
  if (bytes <= st.workspace.bytes()) return;
  MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  st.workspace = Buffer();
  st.workspace = Buffer(MemKind::Device, bytes);
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
  spdlog::debug("attention: cuDNN workspace {}", format_bytes(double(bytes)));
}

// The shape of a call (q [T,Nq,D], k/v [T,Nkv,D], T = batch·S; checked by the front).
AttentionShape attention_shape(const Tensor& q, const Tensor& k, int batch, bool causal) {
  return {batch, q.shape[0] / batch, q.shape[1], k.shape[1], q.shape[2], causal};
}

bool is_empty(const AttentionShape& s) {
  return s.seq == 0 || s.num_q_heads == 0 || s.head_dim == 0;
}

}  // namespace

AttentionState& CudaBackend::attention_state() {
  if (!attention_) {
    const bool deterministic = deterministic_from_env();
    if (deterministic)
      spdlog::info("attention: cuDNN deterministic backward ({}=1)", kDeterministicEnv);
    attention_.reset(new AttentionState(stream_, deterministic));
  }
  return *attention_;
}

void CudaBackend::prepare_attention(const OpShapes& shapes) {
  if (shapes.batch <= 0 || shapes.seq <= 0 || shapes.heads <= 0 || shapes.kv_heads <= 0 ||
      shapes.head_dim <= 0)
    return;
  MOP_CHECK(shapes.heads % shapes.kv_heads == 0, "prepare: ", shapes.heads,
            " query heads are not a multiple of ", shapes.kv_heads, " kv heads");
  AttentionState& st = attention_state();
  if (shapes.seq == 1) {
    single_of(st, stream_);
    return;
  }
  size_t bytes = 0;
  for (bool causal : {true, false}) {
    if (!causal && !shapes.attention_non_causal) continue;
    const AttentionShape s{shapes.batch,    shapes.seq,      shapes.heads,
                           shapes.kv_heads, shapes.head_dim, causal};
    bytes = std::max(bytes, CudnnAttention::workspace_bytes(st.cudnn.plan(AttentionPass::Forward, s)));
    bytes = std::max(bytes, CudnnAttention::workspace_bytes(st.cudnn.plan(AttentionPass::Backward, s)));
  }
  reserve_workspace(st, bytes, stream_);
}

size_t CudaBackend::attention_workspace_bytes() const {
  return attention_ ? attention_->workspace.bytes() : 0;
}

void CudaBackend::attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                            const Tensor& v, int batch, float scale, bool causal) {
  const AttentionShape s = attention_shape(q, k, batch, causal);
  if (is_empty(s)) return;
  AttentionState& st = attention_state();
  const AttentionFwdArgs args{out.data, lse.ptr<float>(), q.data, k.data, v.data, scale};
  if (s.seq == 1) {
    single_of(st, stream_).fwd(s, args);
    return;
  }
  AttentionPlan& plan = st.cudnn.plan(AttentionPass::Forward, s);
  reserve_workspace(st, CudnnAttention::workspace_bytes(plan), stream_);
  st.cudnn.run_fwd(plan, args, st.workspace.data());
}

void CudaBackend::attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            int batch, float scale, bool causal) {
  const AttentionShape s = attention_shape(q, k, batch, causal);
  if (is_empty(s)) return;
  AttentionState& st = attention_state();
  const AttentionBwdArgs args{dq.data, dk.data, dv.data,  dout.data,        q.data,
                              k.data,  v.data,  out.data, lse.ptr<float>(), scale};
  if (s.seq == 1) {
    single_of(st, stream_).bwd(s, args);
    return;
  }
  AttentionPlan& plan = st.cudnn.plan(AttentionPass::Backward, s);
  reserve_workspace(st, CudnnAttention::workspace_bytes(plan), stream_);
  st.cudnn.run_bwd(plan, args, st.workspace.data());
}

}  // namespace mop
