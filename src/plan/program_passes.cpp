// The skeletons and passes that make step programs (see program_passes.h).
#include "plan/program_passes.h"

#include <algorithm>
#include <utility>

namespace mop {

namespace {

Action at(ActionKind k, int group, int micro_batch, StreamKind stream = StreamKind::Compute) {
  return {k, group, group + 1, micro_batch, stream};
}

Action whole(ActionKind k, int micro_batch, StreamKind stream = StreamKind::Compute) {
  return {k, -1, -1, micro_batch, stream};
}

}  // namespace

std::vector<Action> ProgramDraft::flatten() const {
  size_t n = 0;
  for (const Anchor& a : anchors) n += 1 + a.before.size() + a.after.size();
  std::vector<Action> out;
  out.reserve(n);
  for (const Anchor& a : anchors) {
    out.insert(out.end(), a.before.begin(), a.before.end());
    out.push_back(a.action);
    out.insert(out.end(), a.after.begin(), a.after.end());
  }
  return out;
}

ProgramDraft step_skeleton(const ProgramShape& shape, const StepSlots& slots) {
  ProgramDraft d{shape, slots, {}};
  auto add = [&](Action a) { d.anchors.push_back({a, {}, {}}); };
  if (!(shape.sliced && shape.pool_grads)) add(whole(ActionKind::ZeroGrads, -1));
  // Pipeline stages: the rank's passes in the schedule's order, each over its chunk's segments,
  // between the messages of its neighbouring virtual stages.
  for (const PipePass& p : shape.passes) {
    const auto [first, end] = shape.chunks[size_t(p.chunk)];
    const int m = p.micro_batch;
    auto chunk = [&](ActionKind k, StreamKind stream = StreamKind::Compute) {
      return Action{k, first, end, m, stream};
    };
    if (p.forward) {
      add(chunk(ActionKind::BeginForward));
      if (!shape.first_virtual(p.chunk)) add(chunk(ActionKind::RecvActivation));
      for (int s = first; s < end; ++s) add(at(ActionKind::Forward, s, m));
      if (!shape.last_virtual(p.chunk)) add(chunk(ActionKind::SendActivation, StreamKind::Pipe));
    } else {
      add(chunk(ActionKind::BeginBackward));
      if (!shape.last_virtual(p.chunk)) add(chunk(ActionKind::RecvGrad));
      for (int s = end - 1; s >= first; --s) add(at(ActionKind::Backward, s, m));
      if (!shape.first_virtual(p.chunk)) add(chunk(ActionKind::SendGrad, StreamKind::Pipe));
    }
  }
  for (int m = 0; m < shape.micro_batches && !shape.pipelined(); ++m) {
    add(whole(ActionKind::BeginForward, m));
    for (int s = 0; s < shape.segments; ++s) add(at(ActionKind::Forward, s, m));
    add(whole(ActionKind::BeginBackward, m));
    for (int s = shape.segments - 1; s >= 0; --s) add(at(ActionKind::Backward, s, m));
  }
  add(whole(ActionKind::ReadLosses, -1, StreamKind::Host));
  return d;
}

ProgramDraft eval_skeleton(const ProgramShape& shape, const StepSlots& slots) {
  ProgramDraft d{shape, slots, {}};
  d.shape.micro_batches = 1;
  auto add = [&](Action a) { d.anchors.push_back({a, {}, {}}); };
  if (!shape.pipelined()) {
    add(whole(ActionKind::BeginForward, 0));
    for (int s = 0; s < shape.segments; ++s) add(at(ActionKind::Forward, s, 0));
    return d;
  }
  // Pipeline stages: the batch through the rank's chunks in order, between their messages.
  d.shape.passes.clear();
  for (int c = 0; c < int(shape.chunks.size()); ++c) {
    const auto [first, end] = shape.chunks[size_t(c)];
    d.shape.passes.push_back({true, 0, c});
    add({ActionKind::BeginForward, first, end, 0});
    if (!shape.first_virtual(c)) add({ActionKind::RecvActivation, first, end, 0});
    for (int s = first; s < end; ++s) add(at(ActionKind::Forward, s, 0));
    if (!shape.last_virtual(c)) add({ActionKind::SendActivation, first, end, 0, StreamKind::Pipe});
  }
  return d;
}

void add_gathers(ProgramDraft& d) {
  if (!d.shape.sliced) return;
  const int S = d.segments(), tied = d.tied_group(), slots = d.slots.shared_weights;
  std::vector<char> gathered(size_t(S + 1), 0);
  // Per anchor: a forward whose micro-batch's backward over the same chunk is the next pass (its
  // last segments stay for it).
  std::vector<char> backward_next(d.anchors.size(), 0);
  int shared = 0;        // groups bound to the shared slots
  bool pending = false;  // a gather issued since the last join
  size_t tied_last = 0;  // the anchor of the tied embedding's last reader (segment 0 or S-1)
  for (size_t i = 0; i < d.anchors.size(); ++i) {
    const Action& x = d.anchors[i].action;
    if ((x.kind == ActionKind::Forward || x.kind == ActionKind::Backward) &&
        (x.begin == 0 || x.begin == S - 1))
      tied_last = i;
    if (x.kind != ActionKind::Forward) continue;
    size_t j = i + 1;
    while (j < d.anchors.size() && d.anchors[j].action.kind != ActionKind::Forward &&
           d.anchors[j].action.kind != ActionKind::Backward)
      ++j;
    if (j == d.anchors.size()) continue;
    const Action& y = d.anchors[j].action;
    const bool same_chunk = d.shape.chunk_of(y.begin) == d.shape.chunk_of(x.begin);
    if (y.kind == ActionKind::Backward && y.micro_batch == x.micro_batch && same_chunk) backward_next[i] = 1;
  }
  // A pass's earlier forwards take its last forward's flag.
  for (size_t i = d.anchors.size(); i-- > 0;) {
    const Action& x = d.anchors[i].action;
    if (x.kind != ActionKind::Forward || i + 1 >= d.anchors.size()) continue;
    for (size_t j = i + 1; j < d.anchors.size(); ++j) {
      const Action& y = d.anchors[j].action;
      if (y.kind == ActionKind::Forward && y.micro_batch == x.micro_batch &&
          d.shape.chunk_of(y.begin) == d.shape.chunk_of(x.begin)) {
        backward_next[i] = backward_next[j];
        break;
      }
      if (y.kind == ActionKind::Forward || y.kind == ActionKind::Backward) break;
    }
  }
  auto gather = [&](std::vector<Action>& out, int group, int m) {
    if (std::exchange(gathered[size_t(group)], char(1))) return;
    out.push_back(at(ActionKind::Gather, group, m, StreamKind::Gathers));
    shared += group != tied, pending = true;
  };
  // A segment's weights, and the tied embedding's with a segment that reads it.
  auto gather_segment = [&](std::vector<Action>& out, int s, int m) {
    if (tied >= 0 && (s == 0 || s == S - 1)) gather(out, tied, m);
    gather(out, s, m);
  };
  auto release = [&](std::vector<Action>& out, int group, int m) {
    if (!std::exchange(gathered[size_t(group)], char(0))) return;
    out.push_back(at(ActionKind::Release, group, m));
    shared -= group != tied;
  };
  auto join = [&](std::vector<Action>& out, int m) {
    if (std::exchange(pending, false)) out.push_back(whole(ActionKind::JoinGathers, m));
  };
  for (size_t i = 0; i < d.anchors.size(); ++i) {
    ProgramDraft::Anchor& a = d.anchors[i];
    const int s = a.action.begin, m = a.action.micro_batch;
    switch (a.action.kind) {
      case ActionKind::BeginForward:
        gather_segment(a.after, std::max(s, 0), m);
        break;
      case ActionKind::Forward: {
        const int end = d.shape.chunk_of(s).second;
        join(a.before, m);
        if (s + 1 < end) gather_segment(a.before, s + 1, m);
        if (s < end - slots || !backward_next[i]) release(a.after, s, m);
        break;
      }
      case ActionKind::Backward:
        gather_segment(a.before, s, m);
        join(a.before, m);
        if (s > d.shape.chunk_of(s).first && shared < slots) gather_segment(a.before, s - 1, m);
        release(a.after, s, m);
        break;
      default:
        break;
    }
    if (tied >= 0 && i == tied_last) release(a.after, tied, m);
  }
}

void add_weight_waits(ProgramDraft& d) {
  const int S = d.segments();
  auto waits = [&](int s, int m) {
    std::vector<Action> w;
    if (d.host(s)) w.push_back(at(ActionKind::WeightsReady, s, m));
    if (d.shape.device_update_overlapped) w.push_back(at(ActionKind::WaitUpdate, s, m));
    return w;
  };
  // The segment whose weights an action reads first (a gather reads its group's slices).
  auto reads = [&](const Action& x) {
    if (x.kind == ActionKind::Forward) return x.begin;
    if (x.kind == ActionKind::Gather) return x.begin == S ? 0 : x.begin;
    return -1;
  };
  std::vector<char> waited(size_t(S), 0);
  int m = -1;  // the micro-batch whose forward phase this is; -1: none
  auto before_readers = [&](std::vector<Action>& list) {
    for (size_t i = 0; i < list.size(); ++i) {
      const int s = reads(list[i]);
      if (s < 0 || std::exchange(waited[size_t(s)], char(1))) continue;
      const std::vector<Action> w = waits(s, m);
      list.insert(list.begin() + std::ptrdiff_t(i), w.begin(), w.end());
      i += w.size();
    }
  };
  for (ProgramDraft::Anchor& a : d.anchors) {
    if (a.action.kind == ActionKind::BeginForward)
      m = a.action.micro_batch, waited.assign(size_t(S), 0);
    if (a.action.kind == ActionKind::BeginBackward) m = -1;
    if (m < 0) continue;
    before_readers(a.before);
    if (const int s = reads(a.action); s >= 0 && !std::exchange(waited[size_t(s)], char(1))) {
      const std::vector<Action> w = waits(s, m);
      a.before.insert(a.before.end(), w.begin(), w.end());
    }
    before_readers(a.after);
  }
}

void add_grad_slots(ProgramDraft& d) {
  const int S = d.segments(), tied = d.tied_group();
  auto in_slot = [&](int group) {
    if (d.shape.sliced) return d.slots.shared_grads > 0;
    return d.shape.streamed_segment(group == tied ? 0 : group);
  };
  std::vector<int> slotted(size_t(S + 1), -1);  // per group: the micro-batch it has a slot for
  for (ProgramDraft::Anchor& a : d.anchors) {
    const Action& x = a.action;
    std::vector<int> writes;  // the groups whose gradients the action writes
    if (x.kind == ActionKind::Forward && x.begin == S - 1) {
      if (tied >= 0) writes.push_back(tied);
      writes.push_back(x.begin);
    }
    if (x.kind == ActionKind::Backward) {
      if (tied >= 0 && x.begin == 0) writes.push_back(tied);
      writes.push_back(x.begin);
    }
    for (int g : writes)
      if (in_slot(g) && std::exchange(slotted[size_t(g)], x.micro_batch) != x.micro_batch)
        a.before.push_back(at(ActionKind::GradSlot, g, x.micro_batch));
  }
}

void add_reduce_scatters(ProgramDraft& d) {
  if (!d.shape.sliced) return;
  const int tied = d.tied_group();
  for (ProgramDraft::Anchor& a : d.anchors) {
    const int s = a.action.begin, m = a.action.micro_batch;
    if (a.action.kind != ActionKind::Backward || !d.last(m)) continue;
    std::vector<int> groups = {s};
    if (tied >= 0 && s == 0) groups.push_back(tied);
    for (int g : groups) {
      size_t i = 0;  // right after the release of its weights, else at the end
      while (i < a.after.size() &&
             !(a.after[i].kind == ActionKind::Release && a.after[i].begin == g))
        ++i;
      i = i < a.after.size() ? i + 1 : a.after.size();
      a.after.insert(a.after.begin() + std::ptrdiff_t(i), at(ActionKind::ReduceScatter, g, m));
    }
  }
}

void add_grad_sums(ProgramDraft& d) {
  if (d.shape.sliced || !d.shape.reduce) return;
  const StreamKind sums = d.shape.async_reduce ? StreamKind::GradSums : StreamKind::Compute;
  for (ProgramDraft::Anchor& a : d.anchors) {
    const int s = a.action.begin, m = a.action.micro_batch;
    if (a.action.kind == ActionKind::ReadLosses)
      a.before.push_back(whole(ActionKind::JoinReduce, -1));
    if (a.action.kind != ActionKind::Backward || !d.last(m)) continue;
    a.after.push_back(at(ActionKind::ReduceGrads, s, m, sums));
    if (d.host(s) || d.shape.streamed_segment(s))
      a.after.push_back(whole(ActionKind::JoinReduce, m));
  }
}

void add_grad_norms(ProgramDraft& d) {
  for (ProgramDraft::Anchor& a : d.anchors) {
    const int s = a.action.begin, m = a.action.micro_batch;
    if (a.action.kind == ActionKind::Backward && d.last(m) && d.shape.streamed_segment(s))
      a.after.push_back(at(ActionKind::GradNorms, s, m));
  }
}

void add_host_copies(ProgramDraft& d) {
  for (ProgramDraft::Anchor& a : d.anchors) {
    const int s = a.action.begin, m = a.action.micro_batch;
    if (a.action.kind != ActionKind::Backward) continue;
    if (d.last(m) && d.host(s))
      a.after.push_back(at(ActionKind::GradsToHost, s, m, StreamKind::HostCopy));
    if (!d.last(m) && d.shape.streamed_segment(s))
      a.after.push_back(at(ActionKind::StashGrads, s, m, StreamKind::HostCopy));
  }
}

void add_grad_releases(ProgramDraft& d) {
  const int tied = d.tied_group();
  for (ProgramDraft::Anchor& a : d.anchors) {
    const int s = a.action.begin, m = a.action.micro_batch;
    if (a.action.kind != ActionKind::Backward || !d.shape.streamed_segment(s)) continue;
    if (tied >= 0 && s == 0) a.after.push_back(at(ActionKind::ReleaseGrads, tied, m));
    a.after.push_back(at(ActionKind::ReleaseGrads, s, m));
  }
}

std::vector<Action> apply_actions(const ProgramShape& shape) {
  std::vector<Action> a = {whole(ActionKind::Optimizer, -1)};
  if (shape.device_update_overlapped)
    for (int s = 0; s < shape.segments; ++s)
      if (shape.runs(s)) a.push_back(at(ActionKind::DeviceUpdate, s, -1, StreamKind::Update));
  bool any_host = false;
  for (bool h : shape.host_segments) any_host = any_host || h;
  if (any_host) a.push_back(whole(ActionKind::HostUpdate, -1, StreamKind::HostCopy));
  if (shape.zero1) a.push_back(whole(ActionKind::Broadcast, -1));
  return a;
}

}  // namespace mop
