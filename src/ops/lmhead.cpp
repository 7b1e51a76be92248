// Front of the fused LM head + cross-entropy (forward, backward, both at once): the checks, then
// the backend's hooks (cpu/lmhead.cpp, cuda/lmhead.cpp, kernels/lmhead.cu). Targets are
// range-checked by the CPU backend, which reads them.
#include "core/error.h"
#include "ops/ops.h"

namespace mop {
namespace {

struct LmHeadDims {
  int64_t tokens, hidden, vocab;
};

// x [T,H] and w [V,H] compute, workspace acc [C,V] with C ≥ 1, targets I32 [T]; the compute dtype
// through `dt`.
LmHeadDims check_lmhead(const Ops& ops, const Tensor& x, const Tensor& w, const Tensor& targets,
                        const Tensor& workspace, const char* op, DType& dt) {
  MOP_CHECK(x.ndim == 2 && w.ndim == 2 && workspace.ndim == 2, op, ": x ", x.shape_str(), ", w ",
            w.shape_str(), ", workspace ", workspace.shape_str());
  const LmHeadDims s{x.shape[0], x.shape[1], w.shape[0]};
  MOP_CHECK(workspace.shape[0] >= 1, op, ": the workspace holds no rows");
  MOP_CHECK(s.vocab >= 1, op, ": empty vocabulary");
  dt = ops.compute_dtype(x, op);
  ops.expect(x, "lmhead_ce: x", dt, {s.tokens, s.hidden});
  ops.expect(w, "lmhead_ce: w", dt, {s.vocab, s.hidden});
  ops.expect(workspace, "lmhead_ce: workspace", acc_dtype(dt), {workspace.shape[0], s.vocab});
  ops.expect(targets, "lmhead_ce: targets", DType::I32, {s.tokens});
  return s;
}

}  // namespace

void Ops::lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                        const Tensor& targets, Tensor workspace) {
  DType dt;
  const LmHeadDims s = check_lmhead(*this, x, w, targets, workspace, "lmhead_ce_fwd", dt);
  expect(loss, "lmhead_ce_fwd: loss", acc_dtype(dt), {s.tokens});
  expect(lse, "lmhead_ce_fwd: lse", acc_dtype(dt), {s.tokens});
  run(OpId::lmhead_ce_fwd, &OpsBackend::lmhead_ce_fwd, loss, lse, x, w, targets, workspace);
}

void Ops::lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
                        const Tensor& targets, const Tensor& lse, float grad_scale,
                        Tensor workspace) {
  DType dt;
  const LmHeadDims s = check_lmhead(*this, x, w, targets, workspace, "lmhead_ce_bwd", dt);
  expect(dx, "lmhead_ce_bwd: dx", dt, {s.tokens, s.hidden});
  expect(dw, "lmhead_ce_bwd: dw", acc_dtype(dt), {s.vocab, s.hidden});
  expect(lse, "lmhead_ce_bwd: lse", acc_dtype(dt), {s.tokens});
  run(OpId::lmhead_ce_bwd, &OpsBackend::lmhead_ce_bwd, dx, dw, x, w, targets, lse, grad_scale,
      workspace);
}

void Ops::lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                            const Tensor& w, const Tensor& targets, float grad_scale,
                            Tensor workspace) {
  DType dt;
  const LmHeadDims s = check_lmhead(*this, x, w, targets, workspace, "lmhead_ce_fwd_bwd", dt);
  expect(loss, "lmhead_ce_fwd_bwd: loss", acc_dtype(dt), {s.tokens});
  expect(lse, "lmhead_ce_fwd_bwd: lse", acc_dtype(dt), {s.tokens});
  expect(dx, "lmhead_ce_fwd_bwd: dx", dt, {s.tokens, s.hidden});
  expect(dw, "lmhead_ce_fwd_bwd: dw", acc_dtype(dt), {s.vocab, s.hidden});
  run(OpId::lmhead_ce_fwd_bwd, &OpsBackend::lmhead_ce_fwd_bwd, loss, lse, dx, dw, x, w, targets,
      grad_scale, workspace);
}

}  // namespace mop
