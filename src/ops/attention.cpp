// Front of GQA attention (forward, backward): the checks, then the backend's hooks
// (cpu/attention.cpp; cuda/attention.cpp on cuDNN's fused attention).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {
namespace {

struct AttnDims {
  int64_t tokens, seq, q_heads, kv_heads, head_dim;
};

// q [T,Nq,D], k/v [T,Nkv,D], lse acc [batch,Nq,S]; returns the compute dtype through `dt`.
AttnDims check_qkv(const Ops& ops, const Tensor& q, const Tensor& k, const Tensor& v,
                   const Tensor& lse, int batch, const char* op, DType& dt) {
  MOP_CHECK(q.ndim == 3 && k.ndim == 3, op, ": q ", q.shape_str(), " and k ", k.shape_str(),
            " must be [T,heads,D]");
  MOP_CHECK(batch > 0 && q.shape[0] % batch == 0, op, ": ", q.shape[0],
            " tokens do not split into ", batch, " sequences");
  const AttnDims s{q.shape[0], q.shape[0] / batch, q.shape[1], k.shape[1], q.shape[2]};
  MOP_CHECK(s.kv_heads > 0 && s.q_heads % s.kv_heads == 0, op, ": ", s.q_heads,
            " query heads are not a multiple of ", s.kv_heads, " kv heads");
  dt = ops.compute_dtype(q, op);
  ops.expect(q, "attention: q", dt, {s.tokens, s.q_heads, s.head_dim});
  ops.expect(k, "attention: k", dt, {s.tokens, s.kv_heads, s.head_dim});
  ops.expect(v, "attention: v", dt, {s.tokens, s.kv_heads, s.head_dim});
  ops.expect(lse, "attention: lse", acc_dtype(dt), {batch, s.q_heads, s.seq});
  return s;
}

}  // namespace

void Ops::attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                        int batch, float scale, bool causal) {
  DType dt;
  const AttnDims s = check_qkv(*this, q, k, v, lse, batch, "attention_fwd", dt);
  expect(out, "attention_fwd: out", dt, {s.tokens, s.q_heads, s.head_dim});
  run(OpId::attention_fwd, &OpsBackend::attention_fwd, out, lse, q, k, v, batch, scale, causal);
}

void Ops::attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        int batch, float scale, bool causal) {
  DType dt;
  const AttnDims s = check_qkv(*this, q, k, v, lse, batch, "attention_bwd", dt);
  expect(out, "attention_bwd: out", dt, {s.tokens, s.q_heads, s.head_dim});
  expect(dout, "attention_bwd: dout", dt, {s.tokens, s.q_heads, s.head_dim});
  expect(dq, "attention_bwd: dq", dt, {s.tokens, s.q_heads, s.head_dim});
  expect(dk, "attention_bwd: dk", dt, {s.tokens, s.kv_heads, s.head_dim});
  expect(dv, "attention_bwd: dv", dt, {s.tokens, s.kv_heads, s.head_dim});
  run(OpId::attention_bwd, &OpsBackend::attention_bwd, dq, dk, dv, dout, q, k, v, out, lse, batch,
      scale, causal);
}

}  // namespace mop
