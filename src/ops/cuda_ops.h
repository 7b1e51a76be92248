// CudaOps: the CUDA backend of the op interface. Compute tensors are bf16, acc tensors fp32,
// weight gradients fp32 (gemm/grouped GEMM write fp32 C from bf16 A and B). Everything runs on one
// stream in issue order; methods return without synchronising except where a host tensor is
// written (copy to host). Op families live in separate files, each with its own state:
//   cuda_ops.cpp            context, memory ops (fill/copy/add/sum/sumsq routing), prepare
//   cuda_ops_pointwise.cpp  fill/add/sum/sumsq kernels, embedding, RMSNorm, RoPE, SwiGLU, AdamW
//   cuda_ops_gemm.cpp       cuBLASLt GEMM, grouped expert GEMM, fused LM head + cross-entropy
//   cuda_ops_moe.cpp        router, aux loss, route plan, permute/unpermute
//   cuda_ops_attention.cpp  cuDNN fused attention (frontend graphs, plans cached per shape), merge
#pragma once

#include <cuda_runtime.h>

#include <memory>

#include "core/memory.h"
#include "ops/ops.h"

namespace mop {

// Per-family state, defined in the family's file (opaque here).
struct GemmState;
struct AttentionState;
struct MoeState;
struct PointwiseState;
struct GemmStateDeleter { void operator()(GemmState*) const; };
struct AttentionStateDeleter { void operator()(AttentionState*) const; };
struct MoeStateDeleter { void operator()(MoeState*) const; };
struct PointwiseStateDeleter { void operator()(PointwiseState*) const; };

class CudaOps final : public Ops {
 public:
  CudaOps();
  ~CudaOps() override;
  Device device() const override { return Device::CUDA; }
  void synchronize() override;
  void prepare(const OpShapes& shapes) override;
  size_t workspace_bytes() const override;
  Stream stream() const override { return Stream::wrap(Device::CUDA, stream_); }
  cudaStream_t cuda_stream() const { return stream_; }

  void fill(Tensor x, double value) override;
  void copy(Tensor dst, const Tensor& src) override;
  void add(Tensor out, const Tensor& a, const Tensor& b) override;
  void sumsq(Tensor out, const Tensor& x) override;
  void sum(Tensor out, const Tensor& x) override;

  void gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha,
            float beta) override;
  void grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& offsets) override;
  void grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w,
                             const Tensor& offsets) override;
  void grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                               bool accumulate = true) override;

  void embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) override;
  void embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) override;
  void rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) override;
  void rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                   const Tensor& rstd, bool accumulate_dx) override;
  void rope_fwd(Tensor x, const Tensor& pos, float theta) override;
  void rope_bwd(Tensor dx, const Tensor& pos, float theta) override;

  void attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                     int batch, float scale, bool causal) override;
  void attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     int batch, float scale, bool causal) override;
  void attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                       int batch) override;

  void swiglu_fwd(Tensor h, const Tensor& gu) override;
  void swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) override;

  void router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse, const Tensor& logits,
                  bool renormalize) override;
  void router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs, const Tensor& lse,
                  const Tensor& topk_idx, const Tensor& topk_w, const Tensor& aux_grad,
                  float z_grad_scale, bool renormalize) override;
  void moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                    const Tensor& counts, int top_k, float aux_coef, float z_coef) override;
  void moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                      const Tensor& topk_idx) override;
  void moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) override;
  void moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                       bool accumulate) override;
  void moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of, const Tensor& topk_w,
                         bool accumulate) override;
  void moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                         const Tensor& slot_of, const Tensor& topk_w) override;

  void lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                     const Tensor& targets, Tensor workspace) override;
  void lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const Tensor& targets,
                     const Tensor& lse, float grad_scale, Tensor workspace) override;
  void lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                         const Tensor& w, const Tensor& targets, float grad_scale,
                         Tensor workspace) override;

  void adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                  const AdamWArgs& args) override;
  void adamw_step_cast(Tensor param, Tensor m, Tensor v, const Tensor& grad, const AdamWArgs& args,
                       Tensor weights) override;

 private:
  // Family hooks, defined in the family files.
  void prepare_gemm(const OpShapes& shapes);
  // LM head gradients (cuda_ops_gemm.cpp), with the forward's loss and lse when `loss` is given.
  void lmhead(Tensor* loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
              const Tensor& targets, float grad_scale, Tensor workspace, const char* op);
  void prepare_attention(const OpShapes& shapes);
  void prepare_moe(const OpShapes& shapes);
  void prepare_pointwise(const OpShapes& shapes);
  size_t gemm_workspace_bytes() const;
  size_t attention_workspace_bytes() const;
  size_t moe_workspace_bytes() const;
  size_t pointwise_workspace_bytes() const;
  // Elementwise dtype conversion of n elements between device buffers (cuda_ops_pointwise.cpp).
  void convert_device(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n);

  cudaStream_t stream_ = nullptr;
  Buffer staging_;  // pinned: host side of small cross-device conversions
  std::unique_ptr<GemmState, GemmStateDeleter> gemm_;
  std::unique_ptr<AttentionState, AttentionStateDeleter> attention_;
  std::unique_ptr<MoeState, MoeStateDeleter> moe_;
  std::unique_ptr<PointwiseState, PointwiseStateDeleter> pointwise_;
};

}  // namespace mop
