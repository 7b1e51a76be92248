// The step's schedule (see step.h).
#include "schedule/step.h"

#include <algorithm>
#include <map>
#include <optional>
#include <utility>

#include "parallel/watchdog.h"

namespace mop {

StepSchedule::StepSchedule(const Plan& plan, StepProgram program, ModelChunks& model,
                           ParamStore& params, Optimizer& optim, ParallelGroups& groups,
                           TimedOps& timed, std::unique_ptr<TimedOps> update_ops)
    : plan_(plan),
      program_(std::move(program)),
      eval_(make_eval_program(program_.shape)),
      model_(model),
      params_(params),
      optim_(optim),
      groups_(groups),
      timed_(timed) {
  // The pipeline's own device work (the gradients' bf16 conversion) is not part of the time split.
  pipeline_ = make_host_pipeline(timed.inner(), optim.host_params(), int(plan.cfg.optim.host_threads));
  const ModelLayout& layout = params.layout();
  const int segments = num_segments(layout.dims);
  const ProgramShape& shape = program_.shape;
  MOP_CHECK(shape.segments == segments, "a step program of ", shape.segments, " segments for a model of ",
            segments);
  std::vector<bool> host(size_t(segments), false);
  for (const HostParam& hp : optim.host_params()) host[size_t(hp.segment)] = true;
  for (int s = 0; s < segments; ++s)
    MOP_CHECK(host[size_t(s)] == (!shape.host_segments.empty() && shape.host_segments[size_t(s)]),
              "the step program and the optimizer disagree on segment ", s, "'s host update");
  MOP_CHECK(shape.reduce == (plan.stage_size() > 1), "the step program's gradient sums");
  segment_params_.assign(size_t(segments), {});
  for (int p = 0; p < params.num_params(); ++p)
    segment_params_[size_t(param_segment(layout, p))].push_back(p);
  if (shape.reduce && !shape.sliced) reducer_ = std::make_unique<GradReducer>(groups);
  MOP_CHECK(shape.sliced == params.sliced() && (!shape.sliced || shape.pool_grads == params.pools_grads()),
            "the step program and the parameter store disagree on slicing");
  MOP_CHECK((update_ops != nullptr) == shape.device_update_overlapped,
            "the overlapped device update needs its stream's Ops exactly when the program has it");
  MOP_CHECK(shape.streams() == params.streams_grads(), "the step program and the parameter store disagree on "
            "streamed gradients");
  MOP_CHECK(program_.slots == params.slots(), "the step program binds other slots than the parameter store has");
  MOP_CHECK(model.size() == (shape.pipelined() ? int(shape.chunks.size()) : 1),
            "a model of ", model.size(), " chunks for a step program of ", shape.chunks.size());
  for (int c = 0; shape.pipelined() && c < model.size(); ++c)
    MOP_CHECK(model.at(c).first_segment() == shape.chunks[size_t(c)].first &&
                  model.at(c).end_segment() == shape.chunks[size_t(c)].second,
              "the step program's pipeline chunk ", c, " and the model's segments differ");
  if (shape.streams()) {
    for (int p = 0; p < params.num_params(); ++p)
      MOP_CHECK(params.grad_pooled(p) == shape.streamed_segment(param_segment(layout, p)),
                "the step program and the parameter store disagree on parameter ", p, "'s streamed gradients");
    // Between micro-batches every streamed gradient's running sum waits in host memory.
    int64_t total = 0;
    sum_offsets_.assign(size_t(params.num_params()), -1);
    for (int p = 0; p < params.num_params(); ++p)
      if (params.grad_pooled(p) && params.held(p))
        sum_offsets_[size_t(p)] = total, total += aligned_numel(layout.params[p].numel());
    const Device dev = timed.device();
    if (shape.micro_batches > 1)
      sums_ = Buffer(dev == Device::CPU ? MemKind::Host : MemKind::Pinned, size_t(total) * dtype_size(params.grad_dtype()));
    stash_stream_ = OwnedStream(dev);
    const StepSlots& slots = params.slots();
    for (int i = 0; i < slots.shared_grads + int(slots.tied_grads); ++i) slot_free_.emplace_back(dev);
    for (int seg = 0; seg < segments; ++seg) stashed_.emplace_back(dev);
    grads_written_ = Event(dev);
  }
  if (update_ops) {
    MOP_CHECK(optim.host_params().empty() && !plan.parallel.zero1(),
              "an overlapped device update with host-held state or ZeRO-1 owners");
    update_ops_ = std::move(update_ops);
    grads_done_ = Event(timed.device());
    for (int s = 0; s < segments; ++s) update_done_.emplace_back(timed.device());
    update_pending_.assign(size_t(segments), false);
  }
}

StepSchedule::~StepSchedule() {
  stash_stream_.get().synchronize();
  if (pipeline_) pipeline_->drain();
  wait_updates();
  if (update_ops_) update_ops_->synchronize();
}

void StepSchedule::update_segment(int segment) {
  for (int p : segment_params_[size_t(segment)]) {
    optim_.update_native(p, *update_ops_);
    // What the update read is zeroed on its stream (sliced over several replicas: their slices
    // are overwritten by the next reduce-scatter, their slots zeroed on the compute stream).
    if (!model_.writes_gradient(p) && (!params_.sliced() || params_.slice_count(p) == 1))
      update_ops_->fill(optim_.update_grad(p), 0);
  }
  update_done_[size_t(segment)].record(update_ops_->stream());
  update_pending_[size_t(segment)] = true;
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
  // Each over its parameter's replicas (dense weights: every rank of the stage; experts: the ranks
  // that hold the same experts), dense first, in parameter order within each.
  std::map<Axes, std::vector<Tensor>> by_replicas;
  for (int p : segment_params_[size_t(segment)])
    by_replicas[plan_.parallel.replicas(p)].push_back(params_.grad(p));
  for (Axes axes : {kDenseReplicas, kExpertReplicas})
    if (auto it = by_replicas.find(axes); it != by_replicas.end())
      reducer_->reduce(axes, it->second);
}

Comm& StepSchedule::replicas(int p) const {
  return groups_.data(plan_.parallel.replicas(p));
}

void StepSchedule::gather(int group, bool async) {
  params_.bind_weights(group);
  for (int p : params_.group_params(group)) {
    // One replica: the slice is used in place.
    if (params_.slice_count(p) == 1) continue;
    Comm* side = async ? groups_.side(CommKind::Gathers, plan_.parallel.replicas(p)) : nullptr;
    (side ? *side : replicas(p)).all_gather(params_.gathered_weight(p), params_.slice_weight(p));
  }
}

Tensor StepSchedule::running_sum(int p) const {
  const Tensor g = params_.grad(p);
  return Tensor(static_cast<char*>(sums_.data()) + size_t(sum_offsets_[size_t(p)]) * dtype_size(g.dtype), g.dtype,
                {g.numel()}, sums_.device());
}

// A streamed group's slot: zeroed in the first micro-batch (but for what it writes), else the
// running sum back from the host (once its copy there is done); either once the slot's last copy
// to the host is done.
void StepSchedule::streamed_slot(int group, int micro_batch) {
  params_.bind_grads(group);
  timed_.stream().wait(slot_free_[size_t(params_.grad_slot(group))]);
  const int segment = group == int(stashed_.size()) ? 0 : group;  // a tied embedding's: segment 0's
  if (micro_batch > 0) timed_.stream().wait(stashed_[size_t(segment)]);
  for (int p : params_.group_params(group)) {
    const Tensor g = params_.grad(p);
    // On the compute stream, not through Ops::copy (which waits for the host side to be done).
    if (micro_batch > 0) copy_async(g.data, running_sum(p).data, g.bytes(), timed_.stream());
    else if (!model_.writes_gradient(p)) timed_.fill(g, 0);
  }
}

// Segment s's running sums to the host (copy stream) after the backward that wrote them; its
// slots are free again once the copies are done.
void StepSchedule::stash(int segment) {
  grads_written_.record(timed_.stream());
  stash_stream_.get().wait(grads_written_);
  for (int p : segment_params_[size_t(segment)]) {
    const Tensor g = params_.grad(p);
    copy_async(running_sum(p).data, g.data, g.bytes(), stash_stream_.get());
  }
  for (int p : segment_params_[size_t(segment)])
    slot_free_[size_t(params_.grad_slot(params_.gather_group(p)))].record(stash_stream_.get());
  stashed_[size_t(segment)].record(stash_stream_.get());
}

void StepSchedule::reduce_scatter(int group) {
  for (int p : params_.group_params(group)) {
    if (params_.slice_count(p) > 1) replicas(p).reduce_scatter_sum(params_.slice_grad(p), params_.padded_grad(p));
  }
  params_.release_grads(group);
}

// One action of the gradients' or the evaluation's program.
void StepSchedule::run(const Action& a, Run& r) {
  switch (a.kind) {
    case ActionKind::ZeroGrads:
      // Zeroed by the overlapped update of the last step, or here; the first micro-batch writes
      // the experts' gradients.
      {
        // Sliced over several replicas: the whole gradients' slots (padding included), which no
        // update reads. The others (and one replica's slices, which are the gradients) unless
        // the overlapped update zeroed them after reading them.
        const bool zeroed = std::exchange(grads_zeroed_, false);
        for (int p = 0; p < params_.num_params(); ++p)
          if (!params_.held(p)) continue;  // another pipeline stage's
          else if (params_.sliced() && params_.slice_count(p) > 1) timed_.fill(params_.padded_grad(p), 0);
          else if (!zeroed && !model_.writes_gradient(p) && !params_.grad_pooled(p))
            timed_.fill(optim_.update_grad(p), 0);
      }
      break;
    case ActionKind::BeginForward:
      if (program_.shape.pipelined()) {
        const int c = model_.chunk_of(a.begin);
        const Transformer::Pass& p = r.in_flight[{c, a.micro_batch}] = r.begin(a.micro_batch, c);
        if (p.training) timed_.set_phase(StepPhase::Forward);
        break;
      }
      r.pass = r.begin(a.micro_batch, 0);
      if (r.pass->training) timed_.set_phase(StepPhase::Forward);  // evaluation leaves the phase
      break;
    case ActionKind::RecvActivation:
    case ActionKind::SendActivation:
    case ActionKind::RecvGrad:
    case ActionKind::SendGrad:
      message(a, r);
      break;
    case ActionKind::WeightsReady:
      for (int s = a.begin; s < a.end; ++s) pipeline_->weights_ready(s);
      break;
    case ActionKind::WaitUpdate:
      for (int s = a.begin; s < a.end; ++s) wait_update(s);
      break;
    case ActionKind::Forward: {
      const int c = model_.chunk_of(a.begin);
      model_.at(c).forward(pass_of(r, c, a.micro_batch), a.begin, a.end);
      break;
    }
    case ActionKind::BeginBackward:
      // The backward writes gradients: every segment's update has zeroed its own.
      wait_updates();
      // Pipeline stages: the gradient buffer the last backward sent from is written again.
      if (program_.shape.pipelined()) groups_.data(Axes{Axis::Pp}).join();
      timed_.set_phase(StepPhase::Backward);
      break;
    case ActionKind::Backward: {
      const int c = model_.chunk_of(a.begin);
      const Transformer::Pass& p = pass_of(r, c, a.micro_batch);
      model_.at(c).backward(p, a.begin, a.end);
      // Pipeline stages: its backward has run the chunk's first segment, its bank is free.
      if (program_.shape.pipelined() && p.training && a.begin == model_.at(c).first_segment())
        r.held[size_t(c)][size_t(p.bank)] = false;
      break;
    }
    case ActionKind::ReduceGrads:
      for (int s = a.begin; s < a.end; ++s) reduce_segment(s);
      break;
    case ActionKind::JoinReduce:
      reducer_->join();  // timed as communication (TimedComm): the time the compute stream waits
      break;
    case ActionKind::GradsToHost:
      for (int s = a.begin; s < a.end; ++s) pipeline_->grads_final(s, [this](int p) { return params_.grad(p); });
      break;
    case ActionKind::StashGrads:
      for (int s = a.begin; s < a.end; ++s) stash(s);
      break;
    case ActionKind::GradNorms:
      for (int s = a.begin; s < a.end; ++s)
        for (int p : segment_params_[size_t(s)]) optim_.take_norm(p);
      break;
    case ActionKind::ReleaseGrads:
      for (int g = a.begin; g < a.end; ++g) params_.release_grads(g);
      break;
    case ActionKind::Gather:
      for (int g = a.begin; g < a.end; ++g) gather(g, /*async=*/a.stream == StreamKind::Gathers);
      break;
    case ActionKind::JoinGathers:  // timed as communication (TimedComm): the compute stream's wait
      groups_.join(CommKind::Gathers);
      break;
    case ActionKind::Release:
      for (int g = a.begin; g < a.end; ++g) params_.release_weights(g);
      break;
    case ActionKind::GradSlot:
      for (int g = a.begin; g < a.end; ++g) {
        if (!params_.sliced()) {
          streamed_slot(g, a.micro_batch);
          continue;
        }
        params_.bind_grads(g);
        for (int p : params_.group_params(g)) timed_.fill(params_.padded_grad(p), 0);
      }
      break;
    case ActionKind::ReduceScatter:
      for (int g = a.begin; g < a.end; ++g) reduce_scatter(g);
      break;
    case ActionKind::ReadLosses: {
      {
        // Reading the losses waits for the step's device work, NCCL collectives included: a
        // peer that hangs shows up here, so the watchdog times it.
        std::optional<ScopedCollective> watch;
        if (groups_.watchdog) watch.emplace(*groups_.watchdog, "the step's device work");
        r.losses = model_.take_losses();
      }
      double sums[3] = {r.losses.ce_sum, r.losses.aux, r.losses.z};
      groups_.world_host().all_reduce_host(sums, 3, Comm::Op::Sum);
      r.losses = {sums[0], sums[1], sums[2]};
      break;
    }
    default: MOP_CHECK(false, "a step's gradients or evaluation cannot run ", action_name(a.kind));
  }
}

const Transformer::Pass& StepSchedule::pass_of(const Run& r, int chunk, int m) const {
  if (!program_.shape.pipelined()) return *r.pass;
  const auto it = r.in_flight.find({chunk, m});
  MOP_CHECK(it != r.in_flight.end(), "micro-batch ", m, "'s pass over chunk ", chunk, " has not begun");
  return it->second;
}

// The messages of a pipeline rank's chunk with the neighbouring virtual stages (chunk c of rank
// `stage` is virtual stage c · stages + stage; the one after it is on the next rank, after the
// last rank on the first): the activation forward, its gradient back, each tagged by micro-batch,
// the virtual stage it goes to and direction; a host comm's receive has its tensor at once,
// NCCL's once the compute stream joins the comm.
void StepSchedule::message(const Action& a, Run& r) {
  Comm& pipe = groups_.data(Axes{Axis::Pp});
  const ProgramShape& s = program_.shape;
  const int P = s.stages, stage = s.stage, m = a.micro_batch, c = model_.chunk_of(a.begin);
  const int v = c * P + stage, V = int(s.chunks.size()) * P;
  const int prev = (stage + P - 1) % P, next = (stage + 1) % P;
  const auto tag = [&](int to, bool grad) { return 2 * (m * V + to) + int(grad); };
  Transformer& model = model_.at(c);
  const Transformer::Pass& p = pass_of(r, c, m);
  switch (a.kind) {
    case ActionKind::RecvActivation:
      pipe.recv(model.stage_input(p), prev, tag(v, false));
      pipe.join();
      break;
    case ActionKind::SendActivation: pipe.send(model.stage_output(p), next, tag(v + 1, false)); break;
    case ActionKind::RecvGrad:
      pipe.recv(model.stage_output_grad(p), next, tag(v, true));
      pipe.join();
      break;
    case ActionKind::SendGrad:
      pipe.send(model.stage_input_grad(p), prev, tag(v - 1, true));
      r.in_flight.erase({c, m});  // its backward is done on this chunk
      break;
    default: MOP_CHECK(false, "not a pipeline message: ", action_name(a.kind));
  }
}

LossTerms StepSchedule::gradients(const std::function<Batch(int)>& micro_batch, float ce_scale,
                                  float aux_scale) {
  Run r;
  // Pipeline stages: each pass in a bank of its chunk's model that no pass in flight holds (the
  // plan gave each chunk as many as its passes in flight at most).
  for (int c = 0; c < model_.size(); ++c) r.held.emplace_back(size_t(model_.at(c).activations().passes), false);
  r.begin = [&](int m, int c) {
    std::vector<bool>& held = r.held[size_t(c)];
    const auto free = std::find(held.begin(), held.end(), false);
    MOP_CHECK(free != held.end(), "model chunk ", c, ": every bank holds a pass in flight");
    *free = program_.shape.pipelined();
    return model_.at(c).begin(micro_batch(m), aux_scale, /*training=*/true, ce_scale,
                              /*write_experts=*/m == 0, int(free - held.begin()));
  };
  for (const Action& a : program_.gradients) run(a, r);
  if (program_.shape.pipelined()) groups_.data(Axes{Axis::Pp}).join();  // the last sends read
  return r.losses;
}

void StepSchedule::evaluate(const Batch& batch) {
  Run r;
  r.begin = [&](int, int c) { return model_.at(c).begin(batch, 0.0f, /*training=*/false); };
  for (const Action& a : eval_) run(a, r);
  if (program_.shape.pipelined()) groups_.data(Axes{Axis::Pp}).join();  // the last sends read
}

StepReport StepSchedule::apply(float lr) {
  StepReport r;
  bool updating = false;  // the overlapped update has been started
  for (const Action& a : program_.apply) {
    switch (a.kind) {
      case ActionKind::Optimizer:
        r = optim_.step(lr, update_ops_ != nullptr);
        // The last update ran beside this step's forward, which waited for it: reading its times
        // does not wait.
        if (update_ops_) update_stream_seconds_ = update_ops_->collect().total();
        break;
      case ActionKind::DeviceUpdate:
        if (!r.applied) break;
        if (!std::exchange(updating, true)) {
          // After the gradients are final and their norm is read (the compute stream so far), segment
          // by segment in the order the next forward needs them.
          grads_done_.record(timed_.stream());
          update_ops_->stream().wait(grads_done_);
        }
        for (int s = a.begin; s < a.end; ++s) update_segment(s);
        break;
      case ActionKind::HostUpdate: pipeline_->finish_step(r, plan_.cfg.optim.overlap); break;
      case ActionKind::Broadcast:
        if (r.applied) broadcast_weights();
        break;
      default: MOP_CHECK(false, "a step's update cannot run ", action_name(a.kind));
    }
  }
  if (updating) grads_zeroed_ = true;
  return r;
}

void StepSchedule::broadcast_weights() {
  const ParallelSpec& spec = plan_.parallel;
  if (!spec.zero1()) return;
  // Owned host-placed weights must be written (not the state: a two-pass host update may still be
  // writing it, which the broadcast does not need).
  if (pipeline_)
    for (int s = 0; s < num_segments(params_.layout().dims); ++s) pipeline_->weights_ready(s);
  for (int p = 0; p < params_.num_params(); ++p) {
    // Pipeline stages: the stage that runs the parameter's segment (its replicas are of it).
    if (!program_.shape.runs(param_segment(params_.layout(), p))) continue;
    const ParamSharding& s = spec.params[size_t(p)];
    groups_.data(s.replicas).broadcast(params_.weight(p), s.owner);
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
