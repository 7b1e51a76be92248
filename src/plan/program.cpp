// The one-stage step program (see program.h).
#include "plan/program.h"

#include <cstdio>
#include <utility>

#include "model/params.h"

namespace mop {

ProgramShape program_shape(const Plan& plan, int rank) {
  ProgramShape s;
  const ModelLayout layout = ModelLayout::build(plan.dims);
  s.segments = num_segments(plan.dims);
  s.micro_batches = plan.micro_batches;
  s.reduce = plan.world > 1;
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
  return s;
}

bool ProgramShape::streams() const {
  for (bool s : streamed)
    if (s) return true;
  return false;
}

namespace {

// Whole parameters: every micro-batch's forward, then its backward; the last backward hands each
// segment's gradients on (sums, host copies) as soon as they are final. A streamed segment's
// gradients get a slot before they are first written in a micro-batch (zeroed in the first, the
// running sum back from the host in the others) and leave it after its backward: the running sum
// to the host, or (the last) summed over the ranks, their norms taken and sent to the host.
void plain_gradients(const ProgramShape& shape, std::vector<Action>& g) {
  const int S = shape.segments, tied = S;  // the tied embedding's gradient group
  auto host = [&](int s) { return !shape.host_segments.empty() && shape.host_segments[size_t(s)]; };
  auto add = [&](ActionKind k, int s, int m, StreamKind st = StreamKind::Compute) {
    g.push_back({k, s, s + 1, m, st});
  };
  // The gradient groups of segment s: its own, and with a tied head the embedding's.
  auto groups = [&](int s) {
    std::vector<int> out;
    if (shape.tied && s == 0) out.push_back(tied);
    out.push_back(s);
    return out;
  };
  auto slot = [&](int group, int m) {  // the first write of a streamed group in micro-batch m
    const int seg = group == tied ? 0 : group;
    if (shape.streamed_segment(seg)) add(ActionKind::GradSlot, group, m);
  };
  g.push_back({ActionKind::ZeroGrads, -1, -1, -1, StreamKind::Compute});
  const StreamKind sums = shape.async_reduce ? StreamKind::GradSums : StreamKind::Compute;
  for (int m = 0; m < shape.micro_batches; ++m) {
    const bool last = m + 1 == shape.micro_batches;
    g.push_back({ActionKind::BeginForward, -1, -1, m, StreamKind::Compute});
    for (int s = 0; s < S; ++s) {
      if (host(s)) g.push_back({ActionKind::WeightsReady, s, s + 1, m, StreamKind::Compute});
      if (shape.device_update_overlapped) g.push_back({ActionKind::WaitUpdate, s, s + 1, m, StreamKind::Compute});
      if (s == S - 1) {  // the fused LM head writes its gradients (a tied one: the embedding's) in the forward
        if (shape.tied) slot(tied, m);
        slot(s, m);
      }
      g.push_back({ActionKind::Forward, s, s + 1, m, StreamKind::Compute});
    }
    g.push_back({ActionKind::BeginBackward, -1, -1, m, StreamKind::Compute});
    for (int s = S - 1; s >= 0; --s) {
      if (s < S - 1) slot(s, m);
      g.push_back({ActionKind::Backward, s, s + 1, m, StreamKind::Compute});
      if (shape.streamed_segment(s)) {
        if (last) {
          if (shape.reduce) {
            add(ActionKind::ReduceGrads, s, m, sums);
            g.push_back({ActionKind::JoinReduce, -1, -1, m, StreamKind::Compute});
          }
          add(ActionKind::GradNorms, s, m);
          if (host(s)) add(ActionKind::GradsToHost, s, m, StreamKind::HostCopy);
        } else {
          add(ActionKind::StashGrads, s, m, StreamKind::HostCopy);
        }
        for (int grp : groups(s)) add(ActionKind::ReleaseGrads, grp, m);
        continue;
      }
      if (!last) continue;
      // The segment's gradients are final: sum them, and a host update copies the sums.
      if (shape.reduce) {
        g.push_back({ActionKind::ReduceGrads, s, s + 1, m, sums});
        if (host(s)) g.push_back({ActionKind::JoinReduce, -1, -1, m, StreamKind::Compute});
      }
      if (host(s)) g.push_back({ActionKind::GradsToHost, s, s + 1, m, StreamKind::HostCopy});
    }
  }
  if (shape.reduce) g.push_back({ActionKind::JoinReduce, -1, -1, -1, StreamKind::Compute});
  g.push_back({ActionKind::ReadLosses, -1, -1, -1, StreamKind::Host});
}

// Sliced parameters: each segment's weights are gathered before its forward and released after
// (the last two stay for the backward), gathered again before its backward and released after
// it; with one micro-batch its gradients get a slot just before they are first written (the
// backward; the fused LM head's in its forward) and are reduce-scattered (and the slot freed)
// right after its backward. A tied embedding's group is gathered with the first segment that
// reads it and kept until the step's last backward.
// The gathers run on a stream of their own, one segment ahead: the gather of the next segment is
// issued before a segment's forward (before its backward: of the segment before it, once a slot
// is free), and join-gathers makes the compute stream wait for the gathers issued so far just
// before the segment that needs them. A gather waits for the compute work issued before it (what
// last read its slot; the update that wrote its slices).
void sliced_gradients(const ProgramShape& shape, std::vector<Action>& g) {
  const int S = shape.segments, tied = S;  // the tied embedding's gather group
  auto host = [&](int s) { return !shape.host_segments.empty() && shape.host_segments[size_t(s)]; };
  auto add = [&](ActionKind k, int group, int m, StreamKind st = StreamKind::Compute) {
    g.push_back({k, group, group + 1, m, st});
  };
  std::vector<char> gathered(size_t(S + 1), 0), grads(size_t(S + 1), 0);
  int shared = 0;        // gathered segments (the two shared slots)
  bool pending = false;  // a gather issued since the last join
  auto gather = [&](int group, int m) {
    if (std::exchange(gathered[size_t(group)], char(1))) return;
    add(ActionKind::Gather, group, m, StreamKind::Gathers);
    shared += group != tied, pending = true;
  };
  auto release = [&](int group, int m) {
    if (!std::exchange(gathered[size_t(group)], char(0))) return;
    add(ActionKind::Release, group, m);
    shared -= group != tied;
  };
  auto join = [&](int m) {
    if (std::exchange(pending, false)) g.push_back({ActionKind::JoinGathers, -1, -1, m, StreamKind::Compute});
  };
  // Forward: what the slices wait for (the last step's update of them), then the gather.
  auto forward_gather = [&](int s, int m) {
    if (host(s)) add(ActionKind::WeightsReady, s, m);
    if (shape.device_update_overlapped) add(ActionKind::WaitUpdate, s, m);
    if (shape.tied && (s == 0 || s == S - 1)) gather(tied, m);
    gather(s, m);
  };
  // Pooled gradients: a slot for segment s's (and, with the head, the tied embedding's) before
  // they are first written.
  auto grad_slots = [&](int s, int m) {
    if (!shape.pool_grads) return;
    if (shape.tied && s == S - 1 && !std::exchange(grads[size_t(tied)], char(1))) add(ActionKind::GradSlot, tied, m);
    if (!std::exchange(grads[size_t(s)], char(1))) add(ActionKind::GradSlot, s, m);
  };
  if (!shape.pool_grads) g.push_back({ActionKind::ZeroGrads, -1, -1, -1, StreamKind::Compute});
  for (int m = 0; m < shape.micro_batches; ++m) {
    const bool last = m + 1 == shape.micro_batches;
    g.push_back({ActionKind::BeginForward, -1, -1, m, StreamKind::Compute});
    forward_gather(0, m);
    for (int s = 0; s < S; ++s) {
      join(m);
      if (s + 1 < S) forward_gather(s + 1, m);
      // The fused LM head writes its gradients in the forward.
      if (s == S - 1) grad_slots(s, m);
      add(ActionKind::Forward, s, m);
      if (s < S - 2) release(s, m);
    }
    g.push_back({ActionKind::BeginBackward, -1, -1, m, StreamKind::Compute});
    for (int s = S - 1; s >= 0; --s) {
      gather(s, m);
      join(m);
      if (s > 0 && shared < 2) gather(s - 1, m);
      grad_slots(s, m);
      add(ActionKind::Backward, s, m);
      release(s, m);
      if (!last) continue;
      add(ActionKind::ReduceScatter, s, m);
      if (shape.tied && s == 0) release(tied, m), add(ActionKind::ReduceScatter, tied, m);
      if (host(s)) add(ActionKind::GradsToHost, s, m, StreamKind::HostCopy);
    }
  }
  g.push_back({ActionKind::ReadLosses, -1, -1, -1, StreamKind::Host});
}

}  // namespace

StepProgram make_step_program(const ProgramShape& shape) {
  StepProgram prog;
  prog.shape = shape;
  const int S = shape.segments;
  auto host = [&](int s) { return !shape.host_segments.empty() && shape.host_segments[size_t(s)]; };
  auto& g = prog.gradients;
  if (shape.sliced) sliced_gradients(shape, g);
  else plain_gradients(shape, g);

  auto& a = prog.apply;
  a.push_back({ActionKind::Optimizer, -1, -1, -1, StreamKind::Compute});
  if (shape.device_update_overlapped)
    for (int s = 0; s < S; ++s) a.push_back({ActionKind::DeviceUpdate, s, s + 1, -1, StreamKind::Update});
  bool any_host = false;
  for (int s = 0; s < S; ++s) any_host = any_host || host(s);
  if (any_host) a.push_back({ActionKind::HostUpdate, -1, -1, -1, StreamKind::HostCopy});
  if (shape.zero1) a.push_back({ActionKind::Broadcast, -1, -1, -1, StreamKind::Compute});
  return prog;
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
  out += "gradients:\n";
  for (const Action& a : p.gradients) out += describe(a) + "\n";
  out += "apply:\n";
  for (const Action& a : p.apply) out += describe(a) + "\n";
  return out;
}

}  // namespace mop
