// The step program's shape, its composition from the passes (plan/program_passes.h) and its text
// (see program.h).
#include "plan/program.h"

#include <cstdio>

#include "core/error.h"

#include "model/params.h"
#include "plan/program_passes.h"

namespace mop {

ProgramShape program_shape(const Plan& plan, int rank) {
  ProgramShape s;
  const ModelLayout& layout = plan.local_layout();  // the parameters of every rank, in order
  s.segments = num_segments(plan.dims);
  s.micro_batches = plan.micro_batches;
  s.reduce = plan.stage_size() > 1;  // over the replicas of a pipeline stage
  s.async_reduce = s.reduce && plan.run.device != Device::CPU && plan.cfg.parallel.overlap_grad_reduce;
  s.host_segments.assign(size_t(s.segments), false);
  bool any_host = false;
  for (int p = 0; p < int(layout.params.size()); ++p)
    if (!plan.state_on_host.empty() && plan.state_on_host[size_t(p)] && plan.owns(rank, p)) {
      s.host_segments[size_t(param_segment(layout, p))] = true;
      any_host = true;
    }
  s.zero1 = plan.parallel.zero1();
  s.sliced = plan.parallel.sliced();
  s.pool_grads = s.sliced && s.micro_batches == 1;
  s.tied = layout.lm_head == layout.embedding;
  // Streamed gradients: every parameter of a segment whose state is on the host (owned here or
  // not: ZeRO-1 sums them all).
  s.streamed = plan.streamed_segments();
  // Sliced: the sums are issued on the compute stream, each freeing its gradients' slot.
  if (s.sliced) s.async_reduce = false;
  // Sliced: each segment's slices are gathered once their update is done (WaitUpdate first).
  s.device_update_overlapped = plan.cfg.optim.overlap && !any_host && !s.zero1;
  if (plan.pp > 1) set_pipeline(s, plan.split, plan.stage_of(rank), plan.pp_chunks, plan.pp_schedule);
  return s;
}

void set_pipeline(ProgramShape& shape, const StageSplit& split, int stage, int chunks,
                  const std::string& schedule) {
  const int ranks = split.stages() / chunks;
  MOP_CHECK(chunks >= 1 && ranks * chunks == split.stages() && stage >= 0 && stage < ranks,
            "a pipeline of ", split.stages(), " virtual stages for rank ", stage, " with ", chunks, " chunks");
  MOP_CHECK(split.first.back() == shape.segments, "a pipeline split of ", split.first.back(),
            " segments for a step of ", shape.segments);
  shape.stage = stage, shape.stages = ranks;
  shape.chunks.clear();
  for (int c = 0; c < chunks; ++c) {
    const int v = c * ranks + stage;
    shape.chunks.push_back({split.first[size_t(v)], split.first[size_t(v + 1)]});
  }
  shape.passes = schedule == "interleaved" ? interleaved(stage, ranks, shape.micro_batches, chunks)
                                           : one_f_one_b(stage, ranks, shape.micro_batches);
}

bool ProgramShape::streams() const {
  for (bool s : streamed)
    if (s) return true;
  return false;
}

bool ProgramShape::runs(int s) const {
  if (!pipelined()) return s >= 0 && s < segments;
  for (const auto& [first, end] : chunks)
    if (s >= first && s < end) return true;
  return false;
}

std::pair<int, int> ProgramShape::chunk_of(int s) const {
  if (!pipelined()) return {0, segments};
  for (const auto& c : chunks)
    if (s >= c.first && s < c.second) return c;
  MOP_CHECK(false, "segment ", s, " is not run by pipeline rank ", stage);
  return {0, 0};
}

namespace {

// The step's passes, in order (program_passes.h says what each adds and next to what).
constexpr ProgramPass kStepPasses[] = {add_gathers,         add_weight_waits, add_grad_slots,
                                       add_reduce_scatters, add_grad_sums,    add_grad_norms,
                                       add_host_copies,     add_grad_releases};
// Evaluation's: a forward reads the weights, writes no gradients.
constexpr ProgramPass kEvalPasses[] = {add_gathers, add_weight_waits};

}  // namespace

StepSlots program_slots(const ProgramShape& shape) {
  return step_slots(shape.sliced, shape.pool_grads, shape.streams(), shape.tied);
}

StepProgram make_step_program(const ProgramShape& shape) {
  StepProgram prog;
  prog.shape = shape;
  prog.slots = program_slots(shape);
  ProgramDraft d = step_skeleton(shape, prog.slots);
  for (ProgramPass pass : kStepPasses) pass(d);
  prog.gradients = d.flatten();
  prog.apply = apply_actions(shape);
  return prog;
}

std::vector<Action> make_eval_program(const ProgramShape& shape) {
  ProgramDraft d = eval_skeleton(shape, program_slots(shape));
  for (ProgramPass pass : kEvalPasses) pass(d);
  return d.flatten();
}

const char* action_name(ActionKind k) {
  switch (k) {
    case ActionKind::ZeroGrads: return "zero-grads";
    case ActionKind::Gather: return "gather";
    case ActionKind::Release: return "release";
    case ActionKind::GradSlot: return "grad-slot";
    case ActionKind::ReduceScatter: return "reduce-scatter";
    case ActionKind::StashGrads: return "stash-grads";
    case ActionKind::GradNorms: return "grad-norms";
    case ActionKind::ReleaseGrads: return "release-grads";
    case ActionKind::JoinGathers: return "join-gathers";
    case ActionKind::BeginForward: return "begin-forward";
    case ActionKind::WeightsReady: return "weights-ready";
    case ActionKind::WaitUpdate: return "wait-update";
    case ActionKind::Forward: return "forward";
    case ActionKind::BeginBackward: return "begin-backward";
    case ActionKind::Backward: return "backward";
    case ActionKind::ReduceGrads: return "reduce-grads";
    case ActionKind::JoinReduce: return "join-reduce";
    case ActionKind::GradsToHost: return "grads-to-host";
    case ActionKind::ReadLosses: return "read-losses";
    case ActionKind::Optimizer: return "optimizer";
    case ActionKind::DeviceUpdate: return "device-update";
    case ActionKind::HostUpdate: return "host-update";
    case ActionKind::Broadcast: return "broadcast";
    case ActionKind::RecvActivation: return "recv-act";
    case ActionKind::SendActivation: return "send-act";
    case ActionKind::RecvGrad: return "recv-grad";
    case ActionKind::SendGrad: return "send-grad";
  }
  return "?";
}

const char* stream_name(StreamKind s) {
  switch (s) {
    case StreamKind::Compute: return "compute";
    case StreamKind::GradSums: return "grad-sums";
    case StreamKind::Update: return "update";
    case StreamKind::HostCopy: return "host-copy";
    case StreamKind::Gathers: return "gathers";
    case StreamKind::Host: return "host";
    case StreamKind::Pipe: return "pipe";
  }
  return "?";
}

std::string describe(const Action& a) {
  char seg[32] = "", mb[16] = "";
  if (a.begin >= 0) std::snprintf(seg, sizeof seg, "seg [%d,%d)", a.begin, a.end);
  if (a.micro_batch >= 0) std::snprintf(mb, sizeof mb, "mb %d", a.micro_batch);
  char line[128];
  std::snprintf(line, sizeof line, "  %-15s %-12s %-6s %s", action_name(a.kind), seg, mb, stream_name(a.stream));
  return line;
}

std::string program_text(const StepProgram& p) {
  const ProgramShape& s = p.shape;
  std::string out = "step program: " + std::to_string(s.segments) + " segments (embedding, " +
                    std::to_string(s.segments - 2) + " layers, head), " +
                    std::to_string(s.micro_batches) + " micro-batch(es)\n";
  if (s.sliced)
    out += "sliced parameters: gather groups are segments" +
           (s.tied ? "; group " + std::to_string(s.segments) + " is the tied embedding" : std::string()) +
           (s.pool_grads ? "; whole gradients only for the segments in flight" : "; whole gradients kept over the micro-batches") + "\n";
  if (s.streams()) {
    std::string segs;
    for (int i = 0; i < s.segments; ++i)
      if (s.streamed_segment(i)) segs += (segs.empty() ? "" : ", ") + std::to_string(i);
    out += "streamed gradients: segments " + segs + " (in a slot only while in flight" +
           (s.tied && s.streamed_segment(0) ? "; group " + std::to_string(s.segments) + " is the tied embedding's"
                                            : std::string()) +
           (s.micro_batches > 1 ? "; the running sums on the host between micro-batches)\n" : ")\n");
  }
  if (s.pipelined()) {
    out += "pipeline rank " + std::to_string(s.stage) + " of " + std::to_string(s.stages) + ": segments";
    for (const auto& [first, end] : s.chunks) out += " [" + std::to_string(first) + "," + std::to_string(end) + ")";
    out += ", " + std::to_string(s.passes.size()) + " passes\n";
  }
  out += "gradients:\n";
  for (const Action& a : p.gradients) out += describe(a) + "\n";
  out += "apply:\n";
  for (const Action& a : p.apply) out += describe(a) + "\n";
  return out;
}

}  // namespace mop
