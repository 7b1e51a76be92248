// Optimizer step (see optimizer.h). Clipping follows torch.nn.utils.clip_grad_norm_: gradients are
// scaled by min(1, max_norm / (norm + 1e-6)).
#include "optim/optimizer.h"

#include <cmath>
#include <vector>

namespace mop {

Optimizer::Optimizer(const OptimConfig& cfg, ParamStore& params, Ops& ops, MemKind state_mem)
    : cfg_(cfg), params_(params), ops_(ops) {
  size_t bytes = size_t(params.total_elements()) * sizeof(float);
  master_ = Buffer(state_mem, bytes);
  m_ = Buffer(state_mem, bytes);
  v_ = Buffer(state_mem, bytes);
  DType acc = acc_dtype(params.grad_dtype());
  norms_ = Buffer(ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host,
                  size_t(params.num_params()) * dtype_size(acc));
}

void Optimizer::init_weights(uint64_t seed) {
  const ModelLayout& layout = params_.layout();
  std::vector<float> host;  // staging when the state lives on the device
  for (int p = 0; p < params_.num_params(); ++p) {
    Tensor dst = master(p);
    if (dst.device == Device::CPU) {
      init_param(layout, p, dst.ptr<float>(), seed);
    } else {
      host.resize(size_t(dst.numel()));
      init_param(layout, p, host.data(), seed);
      Tensor src = dst;
      src.data = host.data();
      src.device = Device::CPU;
      ops_.copy(dst, src);
    }
  }
  sync_weights();
}

void Optimizer::sync_weights() {
  for (int p = 0; p < params_.num_params(); ++p) ops_.copy(params_.weight(p), master(p));
}

StepReport Optimizer::step(float lr) {
  StepReport r;
  const int n = params_.num_params();
  DType acc = acc_dtype(params_.grad_dtype());
  Device dev = norms_.device();
  auto norm_slot = [&](int p) {
    return Tensor(static_cast<char*>(norms_.data()) + size_t(p) * dtype_size(acc), acc, {1}, dev);
  };
  for (int p = 0; p < n; ++p) ops_.sumsq(norm_slot(p), params_.grad(p));
  std::vector<double> sq(n);
  ops_.copy(Tensor(sq.data(), DType::F64, {n}), Tensor(norms_.data(), acc, {n}, dev));
  double total = 0;
  for (int p = 0; p < n; ++p) {
    if (!std::isfinite(sq[p]) && r.nonfinite_param.empty())
      r.nonfinite_param = params_.layout().params[p].name;
    total += sq[p];
  }
  r.grad_norm = std::sqrt(total);
  if (!r.nonfinite_param.empty()) return r;  // the caller skips the step or aborts

  float scale = 1.0f;
  if (cfg_.grad_clip > 0 && r.grad_norm > cfg_.grad_clip)
    scale = float(cfg_.grad_clip / (r.grad_norm + 1e-6));
  ++updates_;
  AdamWArgs args;
  args.lr = lr;
  args.beta1 = float(cfg_.beta1);
  args.beta2 = float(cfg_.beta2);
  args.eps = float(cfg_.eps);
  args.grad_scale = scale;
  args.bias_correction1 = float(1.0 - std::pow(cfg_.beta1, double(updates_)));
  args.bias_correction2 = float(1.0 - std::pow(cfg_.beta2, double(updates_)));
  for (int p = 0; p < n; ++p) {
    args.weight_decay = params_.layout().params[p].decay ? float(cfg_.weight_decay) : 0.0f;
    ops_.adamw_step_cast(master(p), exp_avg(p), exp_avg_sq(p), params_.grad(p), args,
                         params_.weight(p));
  }
  r.applied = true;
  return r;
}

}  // namespace mop
