// The step's schedule (see step.h).
#include "schedule/step.h"

#include <algorithm>
#include <optional>
#include <utility>

#include "parallel/watchdog.h"

namespace mop {

StepSchedule::StepSchedule(const Plan& plan, Transformer& model, ParamStore& params,
                           Optimizer& optim, ParallelGroups& groups, TimedOps& timed,
                           std::unique_ptr<TimedOps> update_ops)
    : plan_(plan), model_(model), params_(params), optim_(optim), groups_(groups), timed_(timed) {
  // The pipeline's own device work (the gradients' bf16 conversion) is not part of the time split.
  pipeline_ = make_host_pipeline(timed.inner(), optim.host_params(), int(plan.cfg.optim.host_threads));
  const ModelLayout& layout = params.layout();
  const int segments = num_segments(layout.dims);
  if (plan.world > 1) {
    reducer_ = std::make_unique<GradReducer>(groups);
    segment_params_.assign(size_t(segments), {});
    segment_reduced_.assign(size_t(segments), false);
    segment_host_updated_.assign(size_t(segments), false);
    for (int p = 0; p < params.num_params(); ++p)
      segment_params_[size_t(param_segment(layout, p))].push_back(p);
    for (const HostParam& hp : optim.host_params()) segment_host_updated_[size_t(hp.segment)] = true;
  }
  if (update_ops) {
    MOP_CHECK(optim.host_params().empty() && plan.owner.empty(),
              "an overlapped device update with host-held state or ZeRO-1 owners");
    update_ops_ = std::move(update_ops);
    update_params_.assign(size_t(segments), {});
    for (int p = 0; p < params.num_params(); ++p)
      update_params_[size_t(param_segment(layout, p))].push_back(p);
    grads_done_ = Event(timed.device());
    for (int s = 0; s < segments; ++s) update_done_.emplace_back(timed.device());
    update_pending_.assign(size_t(segments), false);
  }
  model.set_hooks({[this](int segment) {
                     if (pipeline_) pipeline_->weights_ready(segment);
                     wait_update(segment);
                   },
                   [this](int segment) {
                     if (last_micro_batch_) segment_done(segment);
                   },
                   [this](bool backward) {
                     // The backward writes gradients: every segment's update has zeroed its own.
                     if (backward) wait_updates();
                     timed_.set_phase(backward ? StepPhase::Backward : StepPhase::Forward);
                   }});
}

StepSchedule::~StepSchedule() {
  model_.set_hooks({});
  if (pipeline_) pipeline_->drain();
  wait_updates();
  if (update_ops_) update_ops_->synchronize();
}

void StepSchedule::issue_updates() {
  // After the gradients are final and their norm is read (the compute stream so far), segment by
  // segment in the order the next forward needs them.
  grads_done_.record(timed_.stream());
  update_ops_->stream().wait(grads_done_);
  for (size_t s = 0; s < update_params_.size(); ++s) {
    for (int p : update_params_[s]) {
      optim_.update_native(p, *update_ops_);
      if (!model_.writes_gradient(p)) update_ops_->fill(params_.grad(p), 0);
    }
    update_done_[s].record(update_ops_->stream());
    update_pending_[s] = true;
  }
  grads_zeroed_ = true;
}

void StepSchedule::wait_update(int segment) {
  if (!update_ops_ || !update_pending_[size_t(segment)]) return;
  timed_.stream().wait(update_done_[size_t(segment)]);
  update_pending_[size_t(segment)] = false;
}

void StepSchedule::wait_updates() {
  for (size_t s = 0; s < update_pending_.size(); ++s) wait_update(int(s));
}

void StepSchedule::reduce_segment(int segment) {
  // Dense weights are replicated on every rank: sum over all of them. Experts are sharded over
  // ep: sum over the ranks that hold the same experts.
  std::vector<Tensor> dense, expert;
  for (int p : segment_params_[size_t(segment)])
    (params_.layout().params[p].kind == ParamKind::Experts ? expert : dense).push_back(params_.grad(p));
  reducer_->reduce(dense, expert);
  segment_reduced_[size_t(segment)] = true;
}

void StepSchedule::segment_done(int segment) {
  if (reducer_) {
    reduce_segment(segment);
    // The host update copies this segment's gradients: they must be summed first.
    if (segment_host_updated_[size_t(segment)]) reducer_->join();
  }
  if (pipeline_) pipeline_->grads_final(segment);
}

LossTerms StepSchedule::gradients(int micro_batches, const std::function<Batch(int)>& micro_batch,
                                  float ce_scale, float aux_scale) {
  // Zeroed by the overlapped update of the last step, or here; the first micro-batch writes the
  // experts' gradients.
  if (!std::exchange(grads_zeroed_, false))
    for (int p = 0; p < params_.num_params(); ++p)
      if (!model_.writes_gradient(p)) timed_.fill(params_.grad(p), 0);
  for (int m = 0; m < micro_batches; ++m) {
    last_micro_batch_ = m + 1 == micro_batches;
    model_.forward_backward(micro_batch(m), ce_scale, aux_scale, /*write_experts=*/m == 0);
  }
  last_micro_batch_ = false;
  if (reducer_) {
    for (size_t s = 0; s < segment_reduced_.size(); ++s)
      if (!segment_reduced_[s]) reduce_segment(int(s));
    reducer_->join();  // timed as communication (TimedComm): the time the compute stream waits
    std::fill(segment_reduced_.begin(), segment_reduced_.end(), false);
  }
  LossTerms lt;
  {
    // Reading the losses waits for the step's device work, NCCL collectives included: a peer
    // that hangs shows up here, so the watchdog times it.
    std::optional<ScopedCollective> watch;
    if (groups_.watchdog) watch.emplace(*groups_.watchdog, "the step's device work");
    lt = model_.take_losses();
  }
  double sums[3] = {lt.ce_sum, lt.aux, lt.z};
  groups_.world_host->all_reduce_host(sums, 3, Comm::Op::Sum);
  return {sums[0], sums[1], sums[2]};
}

StepReport StepSchedule::apply(float lr) {
  StepReport r = optim_.step(lr, update_ops_ != nullptr);
  // The last update ran beside this step's forward, which waited for it: reading its times does
  // not wait.
  if (update_ops_) update_stream_seconds_ = update_ops_->collect().total();
  if (update_ops_ && r.applied) issue_updates();
  if (pipeline_) pipeline_->finish_step(r, plan_.cfg.optim.overlap);
  if (r.applied) broadcast_weights();
  return r;
}

void StepSchedule::broadcast_weights() {
  if (plan_.owner.empty()) return;
  // Owned host-placed weights must be written (not the state: a two-pass host update may still be
  // writing it, which the broadcast does not need).
  if (pipeline_)
    for (int s = 0; s < num_segments(params_.layout().dims); ++s) pipeline_->weights_ready(s);
  for (int p = 0; p < params_.num_params(); ++p) {
    const bool expert = params_.layout().params[p].kind == ParamKind::Experts;
    (expert ? groups_.edp_data : groups_.world_data)->broadcast(params_.weight(p), plan_.owner[size_t(p)]);
  }
}

void StepSchedule::drain() {
  if (pipeline_) pipeline_->drain();
  wait_updates();  // what reads the weights or the state next runs on the compute stream
}

OffloadStats StepSchedule::take_host_stats() {
  return pipeline_ ? pipeline_->take_stats() : OffloadStats{};
}

}  // namespace mop
