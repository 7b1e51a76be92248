// CudaOps attention family: GQA attention (causal or full) forward and backward through cuDNN's
// fused flash attention (cuda_attention_cudnn.h; one-token sequences through
// cuda_attention_len1.h), and the merge of partial results (kernels/attention_merge.cuh). Plans are
// built per shape (B, S, Nq, Nkv, D, mask) in prepare_attention or at the first call with a new
// shape, and one device workspace, sized to the largest plan, serves them all. lse is cuDNN's
// Stats, written in place: fp32 [B,Nq,S], natural-log log-sum-exp of the scaled, masked scores.
#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <memory>

#include <spdlog/spdlog.h>

#include "runtime/cuda_check.h"
#include "kernels/attention_merge.cuh"
#include "ops/cuda_attention_cudnn.h"
#include "ops/cuda_attention_len1.h"
#include "ops/cuda_ops.h"

namespace mop {

// Set to 1 to use cuDNN's deterministic backward (bitwise-reproducible dq at the cost of a
// B·Nq·S²·2-byte workspace; see cuda_attention_cudnn.cpp). Read when a CudaOps first needs
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

AttentionState& state_of(std::unique_ptr<AttentionState, AttentionStateDeleter>& slot,
                         cudaStream_t stream) {
  if (!slot) {
    const bool deterministic = deterministic_from_env();
    if (deterministic)
      spdlog::info("attention: cuDNN deterministic backward ({}=1)", kDeterministicEnv);
    slot.reset(new AttentionState(stream, deterministic));
  }
  return *slot;
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

void expect_device(const Tensor& t, const char* name, DType dtype,
                   std::initializer_list<int64_t> dims) {
  expect_tensor(t, name, Device::CUDA, dtype, dims);
}

// The shape of a call, with the preconditions every attention op shares (ops.h): q [T,Nq,D],
// k/v [T,Nkv,D] bf16, lse fp32 [batch,Nq,S], T = batch·S, Nq a multiple of Nkv.
AttentionShape attention_shape(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& lse,
                               int batch, bool causal, const char* op) {
  MOP_CHECK(q.ndim == 3 && k.ndim == 3, op, ": q ", q.shape_str(), " and k ", k.shape_str(),
            " must be [T,heads,D]");
  MOP_CHECK(batch > 0 && q.shape[0] % batch == 0, op, ": ", q.shape[0],
            " tokens do not split into ", batch, " sequences");
  AttentionShape s{batch, q.shape[0] / batch, q.shape[1], k.shape[1], q.shape[2], causal};
  MOP_CHECK(s.num_kv_heads > 0 && s.num_q_heads % s.num_kv_heads == 0, op, ": ", s.num_q_heads,
            " query heads are not a multiple of ", s.num_kv_heads, " kv heads");
  const int64_t num_tokens = q.shape[0];
  expect_device(q, "attention: q", DType::BF16, {num_tokens, s.num_q_heads, s.head_dim});
  expect_device(k, "attention: k", DType::BF16, {num_tokens, s.num_kv_heads, s.head_dim});
  expect_device(v, "attention: v", DType::BF16, {num_tokens, s.num_kv_heads, s.head_dim});
  expect_device(lse, "attention: lse", DType::F32, {s.batch, s.num_q_heads, s.seq});
  return s;
}

bool is_empty(const AttentionShape& s) {
  return s.seq == 0 || s.num_q_heads == 0 || s.head_dim == 0;
}

}  // namespace

void CudaOps::prepare_attention(const OpShapes& shapes) {
  if (shapes.batch <= 0 || shapes.seq <= 0 || shapes.heads <= 0 || shapes.kv_heads <= 0 ||
      shapes.head_dim <= 0)
    return;
  MOP_CHECK(shapes.heads % shapes.kv_heads == 0, "prepare: ", shapes.heads,
            " query heads are not a multiple of ", shapes.kv_heads, " kv heads");
  AttentionState& st = state_of(attention_, stream_);
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

size_t CudaOps::attention_workspace_bytes() const {
  return attention_ ? attention_->workspace.bytes() : 0;
}

void CudaOps::attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                            const Tensor& v, int batch, float scale, bool causal) {
  const AttentionShape s = attention_shape(q, k, v, lse, batch, causal, "attention_fwd");
  expect_device(out, "attention_fwd: out", DType::BF16, {q.shape[0], s.num_q_heads, s.head_dim});
  if (is_empty(s)) return;
  AttentionState& st = state_of(attention_, stream_);
  const AttentionFwdArgs args{out.data, lse.ptr<float>(), q.data, k.data, v.data, scale};
  if (s.seq == 1) {
    single_of(st, stream_).fwd(s, args);
    return;
  }
  AttentionPlan& plan = st.cudnn.plan(AttentionPass::Forward, s);
  reserve_workspace(st, CudnnAttention::workspace_bytes(plan), stream_);
  st.cudnn.run_fwd(plan, args, st.workspace.data());
}

void CudaOps::attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                            const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                            int batch, float scale, bool causal) {
  const AttentionShape s = attention_shape(q, k, v, lse, batch, causal, "attention_bwd");
  const int64_t num_tokens = q.shape[0];
  expect_device(out, "attention_bwd: out", DType::BF16, {num_tokens, s.num_q_heads, s.head_dim});
  expect_device(dout, "attention_bwd: dout", DType::BF16, {num_tokens, s.num_q_heads, s.head_dim});
  expect_device(dq, "attention_bwd: dq", DType::BF16, {num_tokens, s.num_q_heads, s.head_dim});
  expect_device(dk, "attention_bwd: dk", DType::BF16, {num_tokens, s.num_kv_heads, s.head_dim});
  expect_device(dv, "attention_bwd: dv", DType::BF16, {num_tokens, s.num_kv_heads, s.head_dim});
  if (is_empty(s)) return;
  AttentionState& st = state_of(attention_, stream_);
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

void CudaOps::attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                              int batch) {
  MOP_CHECK(o.ndim == 3 && batch > 0 && o.shape[0] % batch == 0, "attention_merge: o ",
            o.shape_str(), " is not [T,Nq,D] of ", batch, " sequences");
  const int64_t rows = o.shape[0], heads = o.shape[1], dim = o.shape[2], seq = rows / batch;
  expect_device(o, "attention_merge: o", DType::BF16, {rows, heads, dim});
  expect_device(out_acc, "attention_merge: out_acc", DType::F32, {rows, heads, dim});
  expect_device(lse_acc, "attention_merge: lse_acc", DType::F32, {batch, heads, seq});
  expect_device(lse, "attention_merge: lse", DType::F32, {batch, heads, seq});
  kernels::attention_merge(out_acc.ptr<float>(), lse_acc.ptr<float>(),
                           static_cast<const __nv_bfloat16*>(o.data), lse.ptr<float>(), batch, seq,
                           heads, dim, stream_);
}

}  // namespace mop
