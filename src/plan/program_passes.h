// The passes that make step programs (plan/program.h): a skeleton — per micro-batch its forward
// over the segments, then its backward in reverse — and passes that each put what one setting
// needs before and after the skeleton's actions: waits for weights, sliced weights' gathers,
// gradient slots, sums, norms, copies to the host and the slots' releases. make_step_program and
// make_eval_program compose them; a new concern (say pipeline stages' sends and receives) is one
// more pass over a ProgramDraft, the others untouched.
#pragma once

#include <vector>

#include "model/params.h"
#include "plan/program.h"

namespace mop {

// A program being made: the skeleton's actions (anchors) in order, each with what the passes put
// right before and right after it, in the order the passes ran. A pass appends to those lists,
// or inserts next to an action an earlier pass put there where its contract says so; flatten()
// gives the actions in order: per anchor `before`, the anchor, `after`.
struct ProgramDraft {
  struct Anchor {
    Action action;
    std::vector<Action> before, after;
  };
  ProgramShape shape;
  StepSlots slots;  // the buffers the program binds groups to (model/params.h)
  std::vector<Anchor> anchors;

  int segments() const { return shape.segments; }
  int tied_group() const { return shape.tied ? shape.segments : -1; }  // -1: none
  bool host(int s) const { return !shape.host_segments.empty() && shape.host_segments[size_t(s)]; }
  bool last(int micro_batch) const { return micro_batch + 1 == shape.micro_batches; }
  std::vector<Action> flatten() const;
};

using ProgramPass = void (*)(ProgramDraft&);

// The training step's skeleton: zero-grads (unless every gradient is zeroed in its slot: sliced
// with one micro-batch), per micro-batch m begin-forward, forward 0..S-1, begin-backward, backward
// S-1..0; read-losses.
ProgramDraft step_skeleton(const ProgramShape& shape, const StepSlots& slots);
// Evaluation's: begin-forward, forward 0..S-1 (one micro-batch, no gradients).
ProgramDraft eval_skeleton(const ProgramShape& shape, const StepSlots& slots);

// The passes, in the order make_step_program runs them; each does nothing where the shape does
// not need it, and says which earlier pass's actions it places itself next to.
//
// Sliced: each segment's weights are gathered (group g: a slot of the shared ones, every
// replica's slices, on the gathers stream) one segment ahead — the next segment's before a
// segment's forward, the one before's before a backward once a shared slot is free — and
// join-gathers makes the compute stream wait for the gathers issued so far just before the
// segment that needs one. A segment's weights are released after its forward (the last
// `shared_weights` stay for the micro-batch's backward) and after its backward. The tied
// embedding's group is gathered with the first segment that reads it (0 or S-1) into its own
// slot and released after its last reader of the program.
void add_gathers(ProgramDraft& d);
// Each micro-batch's forward waits for each segment's weights (weights-ready: the host update;
// wait-update: the overlapped device update) right before the first action that reads them: the
// segment's forward, or the gather of one of its groups (the tied embedding's is segment 0's).
void add_weight_waits(ProgramDraft& d);
// Gradients in a shared slot (sliced with one micro-batch: every group; streamed: the streamed
// segments' groups) get it (grad-slot, zeroed or the running sum back) in each micro-batch right
// before they are first written: the head's forward writes its own and the tied embedding's (the
// fused LM head), a backward its segment's. Step programs only (the forward writes gradients).
void add_grad_slots(ProgramDraft& d);
// Sliced: after the last micro-batch's backward of a segment, each of its groups (segment 0's
// with the tied embedding's) is reduce-scattered, which frees its gradients' slot: right after
// add_gathers' release of the group's weights.
void add_reduce_scatters(ProgramDraft& d);
// Whole parameters on several ranks: after the last micro-batch's backward of a segment its
// gradients' sums (on the gradient sums' stream with async_reduce), joined at once where the
// compute stream reads them next (a host copy, a streamed segment's norms); every sum joined
// before the losses are read.
void add_grad_sums(ProgramDraft& d);
// Streamed: the last micro-batch's backward of a segment takes its gradients' norms (summed).
void add_grad_norms(ProgramDraft& d);
// After the last micro-batch's backward of a host-updated segment its gradients go to the host
// (grads-to-host); a streamed segment's running sum after every other micro-batch's (stash-grads).
// Both at the end of what the passes before put after the backward.
void add_host_copies(ProgramDraft& d);
// Streamed: after every backward of a segment its groups' slots are freed (the tied embedding's
// with segment 0's, first).
void add_grad_releases(ProgramDraft& d);

// The apply part: the optimizer, the overlapped device update segment by segment, the host update,
// ZeRO-1's broadcast.
std::vector<Action> apply_actions(const ProgramShape& shape);

}  // namespace mop
