// Optimizer step (see optimizer.h). Clipping follows torch.nn.utils.clip_grad_norm_: gradients are
// scaled by min(1, max_norm / (norm + 1e-6)).
#include "optim/optimizer.h"

#include <algorithm>
#include <cmath>
#include <utility>
#include <vector>

#include "core/exact_sum.h"

namespace mop {

Optimizer::Optimizer(const OptimConfig& cfg, ParamStore& params, Ops& ops,
                     std::vector<bool> state_on_host, std::vector<bool> owned)
    : cfg_(cfg), params_(params), ops_(ops), on_host_(std::move(state_on_host)), owned_(std::move(owned)) {
  const int n = params.num_params();
  MOP_CHECK(on_host_.empty() || int(on_host_.size()) == n, "placement of ", on_host_.size(),
            " parameters for ", n);
  // Compact layouts per placement, each parameter aligned like the ParamStore's.
  int64_t total[2] = {0, 0};
  MOP_CHECK(owned_.empty() || int(owned_.size()) == n, "ownership of ", owned_.size(), " parameters");
  for (int p = 0; p < n; ++p) {
    MOP_CHECK(!owns(p) || params.held(p), params.layout().params[p].name, ": owned but not held");
    int where = on_host(p) ? 1 : 0;
    offset_.push_back(total[where]);
    if (owns(p)) total[where] += aligned_numel(state_numel(p));
  }
  const bool gpu = ops.device() == Device::CUDA;
  for (int i = 0; i < 3; ++i) {
    native_[i] = Buffer(gpu ? MemKind::Device : MemKind::Host, size_t(total[0]) * sizeof(float));
    host_[i] = Buffer(gpu ? MemKind::Pinned : MemKind::Host, size_t(total[1]) * sizeof(float));
  }
  norms_ = Buffer(gpu ? MemKind::Device : MemKind::Host, size_t(n) * kGradNormBytes);
  for (int s = 0; s < num_segments(params.layout().dims); ++s)  // forward order
    for (int p = 0; p < n; ++p)
      if (on_host(p) && owns(p) && param_segment(params.layout(), p) == s)
        host_params_.push_back({p, s, master(p), exp_avg(p), exp_avg_sq(p), host_param_grad(p), update_weights(p)});
  norm_taken_.assign(size_t(n), 0);
}

Optimizer::~Optimizer() = default;

int Optimizer::num_host_params() const {
  int k = 0;
  for (int p = 0; p < params_.num_params(); ++p) k += on_host(p) && owns(p);
  return k;
}

int64_t Optimizer::state_numel(int p) const {
  return params_.sliced() ? params_.slice_numel(p) : params_.layout().params[p].numel();
}

Tensor Optimizer::update_grad(int p) const { return params_.sliced() ? params_.slice_grad(p) : params_.grad(p); }

Tensor Optimizer::host_param_grad(int p) const {
  if (!params_.grad_pooled(p) || params_.sliced()) return update_grad(p);
  // Streamed: the gradient has no place of its own; its shape, and the schedule hands it over.
  const auto& shape = params_.layout().params[p].shape;
  Tensor t(nullptr, params_.grad_dtype(), {}, params_.weight(p).device);
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
  return t;
}

Tensor Optimizer::norm_slot(int p) const {
  return Tensor(static_cast<int64_t*>(norms_.data()) + size_t(p) * kGradNormWords, DType::I64,
                {kGradNormWords}, norms_.device());
}

void Optimizer::take_norm(int p) {
  ops_.sumsq(norm_slot(p), update_grad(p));
  norm_taken_[size_t(p)] = 1;
}

Tensor Optimizer::update_weights(int p) const {
  return params_.sliced() ? params_.slice_weight(p) : params_.weight(p);
}

Tensor Optimizer::state(int which, int p) const {
  MOP_CHECK(owns(p), "parameter ", params_.layout().params[p].name, " is updated by another rank");
  const Buffer& b = on_host(p) ? host_[which] : native_[which];
  Tensor t(static_cast<float*>(b.data()) + offset_[p], DType::F32, {}, b.device());
  // A slice of several replicas is flat; a single one is the whole parameter, shaped.
  if (params_.sliced() && params_.slice_count(p) > 1)
    return Tensor(t.data, DType::F32, {params_.slice_numel(p)}, b.device());
  const auto& shape = params_.layout().params[p].shape;
  t.ndim = int(shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = shape[i];
  return t;
}

void Optimizer::init_weights(uint64_t seed) {
  const ModelLayout& layout = params_.layout();
  std::vector<float> host;
  for (int p = 0; p < params_.num_params(); ++p) {
    if (!params_.held(p)) continue;  // another pipeline stage's
    if (params_.sliced()) {  // this rank's slice of the initial values (zeros past the end)
      const int64_t k = params_.slice_numel(p);
      host.assign(size_t(k * params_.slice_count(p)), 0.0f);
      init_param(layout, p, host.data(), seed);
      Tensor src(host.data() + k * params_.slice_index(p), DType::F32, {k});
      if (owns(p)) {
        ops_.copy(master(p), src);
        ops_.copy(params_.slice_weight(p), master(p));
      } else {  // updated by another rank
        ops_.copy(params_.slice_weight(p), src);
      }
      continue;
    }
    host.resize(size_t(layout.params[p].numel()));
    init_param(layout, p, host.data(), seed);
    Tensor src = params_.weight(p);
    src.data = host.data(), src.dtype = DType::F32, src.device = Device::CPU;
    if (owns(p)) {
      ops_.copy(master(p), src);
      ops_.copy(params_.weight(p), master(p));
    } else {
      ops_.copy(params_.weight(p), src);
    }
  }
}

void Optimizer::sync_weights() {
  for (int p = 0; p < params_.num_params(); ++p)
    if (owns(p)) ops_.copy(update_weights(p), master(p));
}

void Optimizer::set_distributed(std::vector<Comm*> norm_comms, Comm* world) {
  MOP_CHECK(norm_comms.empty() || int(norm_comms.size()) == params_.num_params(), "norm comms of ",
            norm_comms.size(), " parameters for ", params_.num_params());
  norm_comms_ = std::move(norm_comms);
  world_ = world;
}

StepReport Optimizer::step(float lr, bool defer_native) {
  StepReport r;
  const int n = params_.num_params();
  for (int p = 0; p < n; ++p)
    if (!std::exchange(norm_taken_[size_t(p)], char(0)) && params_.held(p)) ops_.sumsq(norm_slot(p), update_grad(p));
  // The sums are exact (core/exact_sum.h), and so are their sums here and over the ranks: the norm
  // has the same bits on every layout.
  std::vector<int64_t> words(size_t(n) * kGradNormWords);
  const int64_t num_words = int64_t(words.size());
  if (n > 0)
    ops_.copy(Tensor(words.data(), DType::I64, {num_words}),
              Tensor(norms_.data(), DType::I64, {num_words}, norms_.device()));
  // Per comm (in the order of its first parameter, the same on every rank) the sum of its
  // parameters' sums, summed over its ranks.
  std::vector<std::pair<Comm*, ExactSum>> sums;
  for (int p = 0; p < n; ++p) {
    ExactSum s;
    if (!params_.held(p)) std::fill_n(words.data() + size_t(p) * kGradNormWords, kGradNormWords, 0);
    const int64_t* w = words.data() + size_t(p) * kGradNormWords;
    s.add_words(uint64_t(w[0]), uint64_t(w[1]), uint64_t(w[2]));
    s.bad |= uint64_t(w[3]);
    if (s.bad && r.nonfinite_param.empty()) r.nonfinite_param = params_.layout().params[p].name;
    Comm* comm = norm_comms_.empty() ? nullptr : norm_comms_[size_t(p)];
    auto it =
        std::find_if(sums.begin(), sums.end(), [&](const auto& e) { return e.first == comm; });
    if (it == sums.end()) it = sums.insert(sums.end(), {comm, ExactSum()});
    it->second.add(s);
  }
  ExactSum local;
  for (auto& [comm, sum] : sums) {
    if (comm) {
      double pieces[ExactSum::kPieces];
      sum.to_pieces(pieces);
      comm->all_reduce_host(pieces, ExactSum::kPieces, Comm::Op::Sum);
      sum = ExactSum::from_pieces(pieces);
    }
    local.add(sum);
  }
  if (world_) {
    double bad = world_->all_reduce_host(r.nonfinite_param.empty() ? 0.0 : 1.0, Comm::Op::Max);
    if (bad > 0 && r.nonfinite_param.empty()) r.nonfinite_param = "a parameter on another rank";
  }
  if (local.bad && r.nonfinite_param.empty()) r.nonfinite_param = "the sum of squares (past 2^128)";
  r.grad_norm = std::sqrt(local.value());
  if (!r.nonfinite_param.empty()) return r;  // the caller skips the step or aborts

  float scale = 1.0f;
  if (cfg_.grad_clip > 0 && r.grad_norm > cfg_.grad_clip)
    scale = float(cfg_.grad_clip / (r.grad_norm + 1e-6));
  ++updates_;
  args_ = AdamWArgs();
  args_.lr = lr;
  args_.beta1 = float(cfg_.beta1);
  args_.beta2 = float(cfg_.beta2);
  args_.eps = float(cfg_.eps);
  args_.grad_scale = scale;
  args_.bias_correction1 = float(1.0 - std::pow(cfg_.beta1, double(updates_)));
  args_.bias_correction2 = float(1.0 - std::pow(cfg_.beta2, double(updates_)));
  if (!defer_native)
    for (int p = 0; p < n; ++p)
      if (updates_natively(p)) update_native(p, ops_);
  for (const HostParam& hp : host_params_) r.host_args.push_back(with_decay(hp.param));
  r.applied = true;
  return r;
}

AdamWArgs Optimizer::with_decay(int p) const {
  AdamWArgs a = args_;
  a.weight_decay = params_.layout().params[p].decay ? float(cfg_.weight_decay) : 0.0f;
  return a;
}

void Optimizer::update_native(int p, Ops& ops) const {
  MOP_CHECK(updates_natively(p), "update_native: parameter ", p, " is not updated natively here");
  ops.adamw_step_cast(master(p), exp_avg(p), exp_avg_sq(p), update_grad(p), with_decay(p),
                      update_weights(p));
}

}  // namespace mop
