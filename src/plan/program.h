// The step program: one rank's training step as data — a list of actions (wait for a segment's
// weights, forward or backward segments [a, b) of micro-batch m, sum a segment's gradients over
// the ranks, send them to the host, read the losses, update), each on a named stream, and the
// slots it binds parameter groups to, that the plan makes and the schedule (schedule/step.h)
// executes in order. Made by passes (plan/program_passes.h): a skeleton — every micro-batch's
// forward over all segments, then its backward over all of them — and one pass per concern
// placing its actions around the skeleton's; the last micro-batch's backward hands each segment's
// gradients on as soon as they are final. Evaluation's forward is a program of the same passes.
// `mop plan --program` prints the step's; tests compare programs.
#pragma once

#include <string>
#include <vector>

#include "model/params.h"
#include "plan/pipeline.h"
#include "plan/plan.h"

namespace mop {

enum class ActionKind {
  ZeroGrads,      // zero the gradients the first micro-batch does not write (the overlapped
                  // update of the step before may have zeroed them already)
  BeginForward,   // micro-batch m: its tokens to the device; the forward phase starts
  WeightsReady,   // segment s: its host-updated weights are back (the pipeline's event)
  WaitUpdate,     // segment s: the overlapped device update of the step before is done
  Forward,        // segments [a, b) of micro-batch m, in order
  BeginBackward,  // micro-batch m: the backward phase starts (after every overlapped update:
                  // the backward writes gradients the update zeroes)
  Backward,       // segments [a, b) of micro-batch m, in reverse order
  ReduceGrads,    // segment s: its gradient sums over the data-parallel ranks are issued
  JoinReduce,     // the compute stream waits for the sums issued so far
  GradsToHost,    // segment s: its final gradients start for the host
  ReadLosses,     // the losses are read (watched) and summed over the ranks
  Optimizer,      // global norm, clipping, non-finite check; the device state's AdamW unless
                  // overlapped
  DeviceUpdate,   // segment s: AdamW of its device state and its gradients zeroed, overlapped
                  // with the next step's forward
  HostUpdate,     // AdamW of the host state (overlapped with the next forward where configured)
  Broadcast,      // ZeRO-1: every weight from its owner
  // Sliced parameters (ZeRO-3). Segments [a, b) name gather groups (model/params.h): a segment's
  // parameters, or (tied embedding) the group `segments` of its own.
  Gather,         // group g: a slot for its weights, every replica's slices gathered into it (on
                  // the gathers stream, after the compute work issued so far)
  JoinGathers,    // the compute stream waits for the gathers issued so far
  Release,        // group g: its weights' slot freed
  GradSlot,       // group g: a slot for its whole gradients, zeroed (sliced: one micro-batch;
                  // streamed: the first micro-batch, later ones get the running sum back)
  ReduceScatter,  // group g: its gradients summed over the replicas, each keeping its slice; the
                  // slot freed
  // Streamed gradients (optim.gradients: host; whole parameters): the segments whose state is on
  // the host keep their gradients in the slots of the gradient groups above while in flight.
  StashGrads,     // segment s (not the last micro-batch): its gradients' running sum to the host
  GradNorms,      // segment s: the Σg² of its final gradients (the optimizer's global norm)
  ReleaseGrads,   // group g: its gradients' slot freed
  // Pipeline stages (parallel.pp > 1). Segments [a, b) name the rank's model chunk the message
  // belongs to; the peer is the neighbouring pipeline rank of that chunk's virtual stage.
  RecvActivation,  // micro-batch m: the hidden state entering segment a, from the stage before
  SendActivation,  // micro-batch m: the hidden state leaving segment b − 1, to the stage after
  RecvGrad,        // micro-batch m: the gradient of the hidden state leaving b − 1, from after
  SendGrad,        // micro-batch m: the gradient of the hidden state entering a, to the stage before
};

// Where an action's device work runs.
enum class StreamKind {
  Compute,   // the backend's stream
  GradSums,  // the gradient sums' (several GPU ranks with parallel.overlap_grad_reduce)
  Update,    // the overlapped device update's
  HostCopy,  // the host pipeline's copy and upload streams, and its worker threads
  Gathers,   // the sliced weights' gathers (several GPU ranks; else the compute stream's comms)
  Host,      // the calling thread, no device work of its own
  Pipe,      // the pipeline's sends (after the compute work issued so far)
};

struct Action {
  ActionKind kind;
  int begin = 0, end = 0;  // segments [begin, end) (one segment: end = begin + 1); -1: none
  int micro_batch = -1;    // -1: not of a micro-batch
  StreamKind stream = StreamKind::Compute;
  bool operator==(const Action& o) const = default;
};

// What the program depends on: the step's shape and this rank's placements.
struct ProgramShape {
  int segments = 0;                 // model/params.h: embedding, layers, final norm and head
  int micro_batches = 1;
  bool reduce = false;              // several ranks: gradients are summed over them
  bool async_reduce = false;        // the sums run on a stream of their own (GPU ranks)
  std::vector<bool> host_segments;  // per segment: this rank updates some of it on the host
  bool device_update_overlapped = false;  // optim.overlap with all state on the device, no ZeRO
  bool zero1 = false;               // ZeRO-1 owners broadcast the new weights
  bool sliced = false;              // parallel.shard: slice
  bool pool_grads = false;          // sliced, one micro-batch: whole gradients per segment in flight
  bool tied = false;                // the LM head reads the embedding (a gather group of its own)
  std::vector<bool> streamed;       // per segment: its gradients streamed (empty: none)
  // Pipeline stages (parallel.pp > 1): this rank's pipeline index of `stages`, its model chunks
  // (segments [first, end), consecutive; one per virtual stage it runs: chunk c is virtual stage
  // c · stages + stage) and its passes in order (plan/pipeline.h). Empty passes: no pipeline, the
  // rank runs every segment, each micro-batch's forward then its backward.
  int stage = 0, stages = 1;
  std::vector<std::pair<int, int>> chunks;
  std::vector<PipePass> passes;
  bool streams() const;
  bool streamed_segment(int s) const { return !streamed.empty() && streamed[size_t(s)]; }
  bool pipelined() const { return !passes.empty(); }
  // Whether this rank runs segment s (every segment without a pipeline).
  bool runs(int s) const;
  // The segments [first, end) of the chunk that holds segment s (without a pipeline: all).
  std::pair<int, int> chunk_of(int s) const;
  // Whether chunk c is the model's first / last virtual stage (no receive / no send before it).
  bool first_virtual(int c) const { return c == 0 && stage == 0; }
  bool last_virtual(int c) const { return c + 1 == int(chunks.size()) && stage + 1 == stages; }
};

struct StepProgram {
  ProgramShape shape;
  StepSlots slots;                // the buffers its actions bind groups to (the parameter store's)
  std::vector<Action> gradients;  // the step's forward and backward, up to the losses
  std::vector<Action> apply;      // the optimizer's update
};

// This rank's shape of the plan's step.
ProgramShape program_shape(const Plan& plan, int rank);
// The pipeline's part of a shape: rank `stage` of `split.stages() / chunks` pipeline ranks runs
// virtual stages stage, stage + ranks, ... of `split` (chunks per rank) in `schedule`'s order
// ("1f1b" or "interleaved") over `micro_batches`.
void set_pipeline(ProgramShape& shape, const StageSplit& split, int stage, int chunks,
                  const std::string& schedule);
// The slots a program of this shape binds gather groups and gradients to (model/params.h).
StepSlots program_slots(const ProgramShape& shape);
StepProgram make_step_program(const ProgramShape& shape);
inline StepProgram make_step_program(const Plan& plan, int rank) {
  return make_step_program(program_shape(plan, rank));
}
// Evaluation: one forward without gradients — begin-forward, then per segment what its weights
// wait for, their gathers and releases (sliced), its forward.
std::vector<Action> make_eval_program(const ProgramShape& shape);

const char* action_name(ActionKind k);
const char* stream_name(StreamKind s);
// One action a line, e.g. "  forward     seg [0,1)  mb 0  compute".
std::string describe(const Action& a);
std::string program_text(const StepProgram& p);

}  // namespace mop
