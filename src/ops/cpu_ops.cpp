// The CPU reference backend: CpuOps implements mop::Ops by forwarding each op to its family's
// file (cpu_elementwise, cpu_gemm, cpu_norm, cpu_attention, cpu_router, cpu_permute, cpu_lmhead,
// cpu_adamw), which checks preconditions and runs plain loops in float or double.
#include "ops/cpu_ops.h"

namespace mop {
namespace {

class CpuOps final : public Ops {
 public:
  Device device() const override { return Device::CPU; }

  void fill(Tensor x, double value) override { cpu::fill(x, value); }
  void copy(Tensor dst, const Tensor& src) override { cpu::copy(dst, src); }
  void add(Tensor out, const Tensor& a, const Tensor& b) override { cpu::add(out, a, b); }
  void sumsq(Tensor out, const Tensor& x) override { cpu::sumsq(out, x); }
  void sum(Tensor out, const Tensor& x) override { cpu::sum(out, x); }

  void gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b, float alpha,
            float beta) override {
    cpu::gemm(c, a, trans_a, b, trans_b, alpha, beta);
  }
  void grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w,
                        const Tensor& offsets) override {
    cpu::grouped_gemm_fwd(y, x, w, offsets);
  }
  void grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w,
                             const Tensor& offsets) override {
    cpu::grouped_gemm_bwd_data(dx, dy, w, offsets);
  }
  void grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& offsets,
                               bool accumulate = true) override {
    cpu::grouped_gemm_bwd_weight(dw, dy, x, offsets, accumulate);
  }

  void embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) override {
    cpu::embedding_fwd(out, ids, table);
  }
  void embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) override {
    cpu::embedding_bwd(dtable, ids, dout);
  }

  void rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) override {
    cpu::rmsnorm_fwd(y, rstd, x, w, eps);
  }
  void rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                   const Tensor& rstd, bool accumulate_dx) override {
    cpu::rmsnorm_bwd(dx, dw, dy, x, w, rstd, accumulate_dx);
  }
  void rope_fwd(Tensor x, const Tensor& pos, float theta) override { cpu::rope_fwd(x, pos, theta); }
  void rope_bwd(Tensor dx, const Tensor& pos, float theta) override {
    cpu::rope_bwd(dx, pos, theta);
  }

  void attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                     int batch, float scale, bool causal) override {
    cpu::attention_fwd(out, lse, q, k, v, batch, scale, causal);
  }
  void attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     int batch, float scale, bool causal) override {
    cpu::attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, batch, scale, causal);
  }
  void attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                       int batch) override {
    cpu::attention_merge(out_acc, lse_acc, o, lse, batch);
  }

  void swiglu_fwd(Tensor h, const Tensor& gu) override { cpu::swiglu_fwd(h, gu); }
  void swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) override {
    cpu::swiglu_bwd(dgu, dh, gu);
  }

  void router_fwd(Tensor topk_idx, Tensor topk_w, Tensor probs, Tensor lse, const Tensor& logits,
                  bool renormalize) override {
    cpu::router_fwd(topk_idx, topk_w, probs, lse, logits, renormalize);
  }
  void router_bwd(Tensor dlogits, const Tensor& dtopk_w, const Tensor& probs, const Tensor& lse,
                  const Tensor& topk_idx, const Tensor& topk_w, const Tensor& aux_grad,
                  float z_grad_scale, bool renormalize) override {
    cpu::router_bwd(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                    renormalize);
  }
  void moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                    const Tensor& counts, int top_k, float aux_coef, float z_coef) override {
    cpu::moe_aux_loss(losses, aux_grad, probs, lse, counts, top_k, aux_coef, z_coef);
  }

  void moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                      const Tensor& topk_idx) override {
    cpu::moe_route_plan(counts, offsets, perm_src, slot_of, topk_idx);
  }
  void moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) override {
    cpu::moe_permute_fwd(xp, x, perm_src);
  }
  void moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                       bool accumulate) override {
    cpu::moe_permute_bwd(dx, dxp, slot_of, top_k, accumulate);
  }
  void moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of, const Tensor& topk_w,
                         bool accumulate) override {
    cpu::moe_unpermute_fwd(y, yp, slot_of, topk_w, accumulate);
  }
  void moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                         const Tensor& slot_of, const Tensor& topk_w) override {
    cpu::moe_unpermute_bwd(dyp, dtopk_w, dy, yp, slot_of, topk_w);
  }

  void lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                     const Tensor& targets, Tensor workspace) override {
    cpu::lmhead_ce_fwd(loss, lse, x, w, targets, workspace);
  }
  void lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const Tensor& targets,
                     const Tensor& lse, float grad_scale, Tensor workspace) override {
    cpu::lmhead_ce_bwd(dx, dw, x, w, targets, lse, grad_scale, workspace);
  }
  void lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                         const Tensor& w, const Tensor& targets, float grad_scale,
                         Tensor workspace) override {
    cpu::lmhead_ce_fwd_bwd(loss, lse, dx, dw, x, w, targets, grad_scale, workspace);
  }

  void adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                  const AdamWArgs& args) override {
    cpu::adamw_step(param, m, v, grad, args);
  }
};

}  // namespace

std::unique_ptr<Ops> make_cpu_ops() {
  return std::make_unique<CpuOps>();
}

}  // namespace mop
