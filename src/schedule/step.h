// The training step's schedule: it runs the step program (plan/program.h) action by action.
//   gradients() runs the program's gradients part:
//     1. the gradients are zeroed (unless the overlapped update of the step before did);
//     2. each micro-batch: its forward, segment by segment, each after its weights are ready —
//        the previous step's host update of them (HostPipeline::weights_ready) or overlapped
//        device update — then its backward in reverse; in the last micro-batch's backward, as
//        soon as a segment's gradients are final, their data-parallel sums are issued
//        (GradReducer; on GPUs on a stream of their own, overlapped with the backward of the
//        earlier segments), and a host-updated segment's gradients go to the host once summed
//        (HostPipeline::grads_final);
//     3. the compute stream waits for the sums;
//     4. the losses are read (watched: a hung peer shows up here) and summed over the ranks.
//   evaluate() runs evaluation's program (a forward of one batch) through the same actions.
//   apply() runs its apply part:
//     5. the optimizer: global norm, clipping, non-finite check, the device-held state's AdamW —
//        with optim.overlap and every parameter's state with the backend (no host state, no
//        ZeRO-1), on a stream of its own, segment by segment, each followed by zeroing that
//        segment's gradients: the next forward of a segment waits only for its own update (an
//        event), the next backward for all of them; the same kernels, so the same bits;
//     6. the host-held state's AdamW through the host pipeline (overlapped with the next step's
//        forward with optim.overlap), or, when the step is skipped, its gradient copies dropped;
//     7. ZeRO-1: each parameter's owner broadcasts its new weights.
#pragma once

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

#include "model/model_chunks.h"
#include "ops/timed_ops.h"
#include "optim/optimizer.h"
#include "parallel/grad_reducer.h"
#include "parallel/groups.h"
#include "plan/plan.h"
#include "plan/program.h"
#include "runtime/runtime.h"
#include "schedule/host_pipeline.h"

namespace mop {

class StepSchedule {
 public:
  // Runs `program` (this rank's, plan/program.h); builds the host pipeline for the optimizer's
  // host params. update_ops: the Ops of the stream that runs the device-held state's AdamW
  // overlapped with the next step (step 5), exactly when the program has device-update actions.
  // Timed: its ops' time is update_stream_seconds(). model: one chunk per chunk of the program's
  // pipeline rank (one without a pipeline).
  StepSchedule(const Plan& plan, StepProgram program, ModelChunks& model, ParamStore& params,
               Optimizer& optim, ParallelGroups& groups, TimedOps& timed,
               std::unique_ptr<TimedOps> update_ops = nullptr);
  ~StepSchedule();
  StepSchedule(const StepSchedule&) = delete;
  StepSchedule& operator=(const StepSchedule&) = delete;

  // Steps 1–4 over the program's micro-batches (micro_batch(m) gives the m-th on the ops device).
  // ce_scale weights each unmasked token's cross-entropy, aux_scale the router losses of a
  // micro-batch. Returns the loss sums over all ranks.
  LossTerms gradients(const std::function<Batch(int)>& micro_batch, float ce_scale, float aux_scale);
  // A forward without gradients (evaluation): the evaluation program (plan/program.h,
  // make_eval_program) — per segment what its weights wait for, their gathers (sliced), its
  // forward — run by the same actions as the step's.
  void evaluate(const Batch& batch);
  // Steps 5–7.
  StepReport apply(float lr);
  // ZeRO-1: every weight from its owner (also after loading a checkpoint).
  void broadcast_weights();
  // Waits for the host pipeline's work (before the host-held state is read or saved).
  void drain();
  OffloadStats take_host_stats();
  // Host memory of its own: the streamed gradients' running sums.
  size_t host_bytes() const { return sums_.bytes(); }
  // The device time of the overlapped update that ran during this step (issued at the end of the
  // step before), on its own stream; 0 without one. Read after apply().
  double update_stream_seconds() const { return update_stream_seconds_; }
  const StepProgram& program() const { return program_; }
  const std::vector<Action>& eval_program() const { return eval_; }
  HostPipeline* host_pipeline() { return pipeline_.get(); }
  const HostPipeline* host_pipeline() const { return pipeline_.get(); }

 private:
  // A program's run: how its micro-batches begin (training or evaluation), the model's pass over
  // the current one, the losses it read.
  struct Run {
    std::function<Transformer::Pass(int m, int chunk)> begin;  // micro-batch m's pass over a chunk
    std::optional<Transformer::Pass> pass;
    // Pipeline stages: the passes begun, by (chunk, micro-batch), and per chunk which of its
    // model's banks a pass holds (from its begin until its backward has run the chunk's first
    // segment).
    std::map<std::pair<int, int>, Transformer::Pass> in_flight;
    std::vector<std::vector<bool>> held;
    LossTerms losses;
  };
  // The pass of micro-batch m (pipeline stages: of those in flight).
  const Transformer::Pass& pass_of(const Run& r, int chunk, int m) const;
  // Pipeline stages: a message of micro-batch m (its activation, or its gradient) to or from the
  // neighbouring pipeline rank.
  void message(const Action& a, Run& r);
  void run(const Action& a, Run& r);
  void reduce_segment(int segment);
  // Sliced parameters: gather group g's weights into their slot; sum its gradients over the
  // replicas into each one's slice and free the slot.
  Comm& replicas(int p) const;
  void gather(int group, bool async);  // async: on the gathers' stream where there is one
  void reduce_scatter(int group);
  // Streamed gradients (optim.gradients: host): a group's slot for micro-batch m; a segment's
  // running sums to the host; parameter p's running sum there.
  void streamed_slot(int group, int micro_batch);
  void stash(int segment);
  Tensor running_sum(int p) const;
  void update_segment(int segment);  // step 5 on the update stream
  void wait_update(int segment);     // the compute stream waits for a segment's update
  void wait_updates();

  const Plan& plan_;
  const StepProgram program_;
  const std::vector<Action> eval_;  // evaluation's program, of the step's shape
  ModelChunks& model_;
  ParamStore& params_;
  Optimizer& optim_;
  ParallelGroups& groups_;
  TimedOps& timed_;
  std::unique_ptr<HostPipeline> pipeline_;
  std::unique_ptr<GradReducer> reducer_;               // several ranks only
  std::vector<std::vector<int>> segment_params_;       // parameters by segment
  // Overlapped device AdamW (update_ops_ set): an event after the gradients are final, per
  // segment an event after its update and gradient zeroing, and whether the compute stream still
  // has to wait for it.
  Event grads_done_;
  std::vector<Event> update_done_;
  std::vector<bool> update_pending_;
  bool grads_zeroed_ = false;  // the update stream zeroed every gradient after the last step
  std::unique_ptr<TimedOps> update_ops_;
  // Streamed gradients: the running sums in host memory (several micro-batches), per parameter its
  // offset there (-1: not streamed), the stream that copies them, an event after the backward
  // that wrote them, per gradient slot an event after its last copy, per segment one after its.
  Buffer sums_;
  std::vector<int64_t> sum_offsets_;
  OwnedStream stash_stream_;
  Event grads_written_;
  std::vector<Event> slot_free_;  // per gradient slot (ParamStore::slots(): shared, the tied one)
  std::vector<Event> stashed_;  // per segment: its last running sums on the host
  double update_stream_seconds_ = 0;  // the last update's, read in apply() before the next
};

}  // namespace mop
