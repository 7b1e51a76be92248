// Internal to the CPU reference backend: precondition helpers, float/double dispatch, and the
// entry points of each op family (one cpu_<family>.cpp each). CpuOps in cpu_ops.cpp forwards
// every virtual of mop::Ops to these functions; nothing outside src/ops/cpu_*.cpp includes this.
// On the CPU the acc dtype equals the compute dtype (acc_dtype(F32) = F32, acc_dtype(F64) = F64),
// so every kernel is templated on one element type T that serves as both.
#pragma once

#include <cstdint>
#include <initializer_list>

#include "core/tensor.h"
#include "ops/ops.h"

namespace mop::cpu {

// Device CPU, the given dtype and exactly the given shape; data set when there are elements.
inline void expect(const Tensor& t, const char* name, DType dtype,
                   std::initializer_list<int64_t> dims) {
  expect_tensor(t, name, Device::CPU, dtype, dims);
}

// The compute dtype of a run on the CPU: F32 or F64 (bf16 compute is the GPU backend's).
inline DType compute_dtype(const Tensor& t, const char* name) {
  MOP_CHECK(t.dtype == DType::F32 || t.dtype == DType::F64, name, " has dtype ",
            dtype_name(t.dtype), "; the CPU backend computes in f32 or f64");
  return t.dtype;
}

// Calls f(T{}) with T = float or double for a compute dtype.
template <class F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      f(float{});
      return;
    case DType::F64:
      f(double{});
      return;
    default:
      MOP_CHECK(false, "dtype ", dtype_name(dtype), " is not a CPU compute dtype");
  }
}

// ---- cpu_elementwise.cpp ----------------------------------------------------------------------
void fill(Tensor x, double value);
void copy(Tensor dst, const Tensor& src);
void add(Tensor out, const Tensor& a, const Tensor& b);
void sumsq(Tensor out, const Tensor& x);
void sum(Tensor out, const Tensor& x);
void embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table);
void embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout);
void swiglu_fwd(Tensor h, const Tensor& gu);
void swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu);

// ---- cpu_gemm.cpp -----------------------------------------------------------------------------
void gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha,
          float beta);
void grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets);
void grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w, const Tensor& offsets);
void grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                             bool accumulate = true);

// ---- cpu_norm.cpp (RMSNorm, RoPE) -------------------------------------------------------------
void rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps);
void rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                 const Tensor& rstd, bool accumulate_dx);
void rope_fwd(Tensor x, const Tensor& pos, float theta);
void rope_bwd(Tensor dx, const Tensor& pos, float theta);

// ---- cpu_attention.cpp ------------------------------------------------------------------------
void attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                   int batch, float scale, bool causal);
void attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                   const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                   int batch, float scale, bool causal);
// ---- cpu_attention_merge.cpp ------------------------------------------------------------------
void attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse, int batch);

// ---- cpu_router.cpp ---------------------------------------------------------------------------
void router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse, const Tensor& logits,
                bool renormalize);
void router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs, const Tensor& lse,
                const Tensor& topk_idx, const Tensor& topk_w, const Tensor& aux_grad,
                float z_grad_scale, bool renormalize);
void moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                  const Tensor& counts, int top_k, float aux_coef, float z_coef);

// ---- cpu_permute.cpp --------------------------------------------------------------------------
void moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                    const Tensor& topk_idx);
void moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src);
void moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                     bool accumulate);
void moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of, const Tensor& topk_w,
                       bool accumulate);
void moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                       const Tensor& slot_of, const Tensor& topk_w);

// ---- cpu_lmhead.cpp ---------------------------------------------------------------------------
void lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w, const Tensor& targets,
                   Tensor workspace);
void lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const Tensor& targets,
                   const Tensor& lse, float grad_scale, Tensor workspace);
void lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                       const Tensor& w, const Tensor& targets, float grad_scale, Tensor workspace);

// ---- cpu_adamw.cpp ----------------------------------------------------------------------------
void adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad, const AdamWArgs& args);

}  // namespace mop::cpu
