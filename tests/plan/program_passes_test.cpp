// The step program's passes (plan/program_passes.h) against the generators they replaced: for a
// grid of every shape the plan can make (segments 3–7, 1–3 micro-batches, sums on their own
// stream or not, host-updated segments, the overlapped device update, ZeRO-1 owners, sliced
// parameters, tied embeddings, streamed gradients) make_step_program gives exactly the program of
// the pre-redesign generators, kept verbatim below. Also evaluation's program against the
// parameter store's slots.
#include <functional>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "model/params.h"
#include "plan/program.h"

using namespace mop;

// The pre-redesign reference: plain_gradients, sliced_gradients and make_step_program of
// src/plan/program.cpp at 8b9724d, verbatim (only the enclosing namespace and this comment added). Kept here
// as the definition the passes are checked against, not to be edited.
namespace reference {

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

}  // namespace reference

namespace {

// Segments as a string of 0/1 ("" for none), for the failure line.
std::string bits(const std::vector<bool>& v) {
  std::string out;
  for (bool b : v) out += b ? '1' : '0';
  return out;
}

// Host-updated (or streamed) segment patterns of S segments: none, all, every other (both
// phases), the first only, the last only, all but the first.
std::vector<std::vector<bool>> patterns(int S) {
  std::vector<std::vector<bool>> out(7, std::vector<bool>(size_t(S), false));
  for (int s = 0; s < S; ++s) {
    out[1][size_t(s)] = true;
    out[2][size_t(s)] = s % 2 == 0;
    out[3][size_t(s)] = s % 2 == 1;
    out[6][size_t(s)] = s > 0;
  }
  out[4][0] = true;
  out[5][size_t(S - 1)] = true;
  return out;
}

bool any(const std::vector<bool>& v) {
  for (bool b : v)
    if (b) return true;
  return false;
}

// Every shape program_shape() can make (see it and plan.cpp): sliced parameters sum on the compute
// stream with no ZeRO-1 owners and nothing streamed, their gradients pooled exactly with one
// micro-batch; ZeRO-1 and the sums' own stream only with several ranks; the overlapped device
// update only without host-updated segments or ZeRO-1; streamed segments are the segments with
// host state (on any rank), so without ZeRO-1 they are this rank's host segments, with it this
// rank's are some of them.
void for_each_shape(const std::function<void(const ProgramShape&)>& f) {
  for (int S = 3; S <= 7; ++S)
    for (int mb = 1; mb <= 3; ++mb)
      for (bool tied : {false, true})
        for (bool reduce : {false, true})
          for (bool async : {false, true})
            for (bool zero1 : {false, true})
              for (bool sliced : {false, true})
                for (bool overlapped : {false, true}) {
                  if ((async || zero1) && !reduce) continue;
                  if (sliced && (async || zero1)) continue;
                  if (overlapped && zero1) continue;
                  ProgramShape base;
                  base.segments = S, base.micro_batches = mb, base.tied = tied, base.reduce = reduce;
                  base.async_reduce = async, base.zero1 = zero1, base.sliced = sliced;
                  base.pool_grads = sliced && mb == 1, base.device_update_overlapped = overlapped;
                  for (const std::vector<bool>& host : patterns(S)) {  // nothing streamed
                    if (overlapped && any(host)) continue;
                    ProgramShape s = base;
                    s.host_segments = host;
                    f(s);
                  }
                  if (sliced || overlapped) continue;
                  for (const std::vector<bool>& streamed : patterns(S)) {
                    if (!any(streamed)) continue;
                    std::vector<std::vector<bool>> hosts = {streamed};
                    if (zero1) {  // this rank owns some of the streamed segments, or none
                      hosts.push_back(std::vector<bool>(size_t(S), false));
                      std::vector<bool> some = streamed;
                      for (int s = 0; s < S; s += 2) some[size_t(s)] = false;
                      hosts.push_back(some);
                    }
                    for (const std::vector<bool>& host : hosts) {
                      ProgramShape s = base;
                      s.streamed = streamed, s.host_segments = host;
                      f(s);
                    }
                  }
                }
}

std::string text(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions) out += describe(a) + "\n";
  return out;
}

}  // namespace

TEST_CASE("program passes: every shape's program equals the pre-redesign generators'", "[cpu][plan]") {
  int shapes = 0, sliced = 0, streamed = 0;
  for_each_shape([&](const ProgramShape& shape) {
    INFO("segments " << shape.segments << " micro-batches " << shape.micro_batches << " tied " << shape.tied
                     << " reduce " << shape.reduce << " async " << shape.async_reduce << " zero1 " << shape.zero1
                     << " sliced " << shape.sliced << " overlapped " << shape.device_update_overlapped << " host "
                     << bits(shape.host_segments) << " streamed " << bits(shape.streamed));
    const StepProgram want = reference::make_step_program(shape);
    const StepProgram got = make_step_program(shape);
    // The text first: a failure shows the two programs.
    REQUIRE(text(got.gradients) == text(want.gradients));
    CHECK(got.gradients == want.gradients);
    CHECK(got.apply == want.apply);
    CHECK(got.slots == program_slots(shape));
    ++shapes, sliced += shape.sliced, streamed += shape.streams();
  });
  CHECK(shapes > 2000);
  CHECK(sliced > 300);
  CHECK(streamed > 300);
}

namespace {

Plan tiny_plan(const std::vector<std::string>& overrides) {
  const Config cfg = load_config(std::string(MOP_SOURCE_DIR) + "/configs/tiny.yaml", overrides);
  return make_plan(cfg, builtin_machine("cpu"), 1);
}

// "name[ segment][ mMB][ (stream)]" per action, joined by " | "; the compute stream left out.
std::string compact(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions) {
    if (!out.empty()) out += " | ";
    out += action_name(a.kind);
    if (a.begin >= 0) out += " " + std::to_string(a.begin);
    if (a.micro_batch >= 0) out += " m" + std::to_string(a.micro_batch);
    if (a.stream != StreamKind::Compute) out += std::string(" (") + stream_name(a.stream) + ")";
  }
  return out;
}

// The parameter store the trainer builds for a one-rank plan (train/trainer.cpp), sizes only.
ParamStore plan_store(const Plan& plan, const ModelLayout& layout) {
  if (plan.parallel.sliced())
    return ParamStore(layout, DType::F32, DType::F32, MemKind::Host,
                      param_slices(plan.parallel, 0, plan.micro_batches, /*allocate=*/false));
  if (plan.stream_grads)
    return ParamStore(layout, DType::F32, DType::F32, MemKind::Host, PooledGrads{plan.streamed_segments(), false});
  return ParamStore(layout, DType::F32, DType::F32, MemKind::Host, /*allocate=*/false);
}

}  // namespace

TEST_CASE("program passes: the program's slots are the parameter store's", "[cpu][plan]") {
  for (const bool tied : {false, true})
    for (const int mb : {1, 3})
      for (const std::string& mode : {"whole", "slice", "streamed"}) {
        INFO("tied " << tied << " micro-batches " << mb << " " << mode);
        std::vector<std::string> o = {"train.global_batch_size=" + std::to_string(8 * mb),
                                      std::string("model.tie_embeddings=") + (tied ? "true" : "false")};
        if (mode == "slice") o.push_back("parallel.shard=slice");
        if (mode == "streamed") o.push_back("optim.state_placement=host"), o.push_back("optim.gradients=host");
        const Plan plan = tiny_plan(o);
        REQUIRE(plan.micro_batches == mb);
        REQUIRE(plan.parallel.sliced() == (mode == "slice"));
        REQUIRE(plan.stream_grads == (mode == "streamed"));
        const ModelLayout layout = ModelLayout::build(plan.dims);
        const StepProgram p = make_step_program(plan, 0);
        CHECK(p.slots == plan_store(plan, layout).slots());
        CHECK(p.slots.shared_weights == (mode == "slice" ? kSharedSlots : 0));
        CHECK(p.slots.tied_weights == (mode == "slice" && tied));
        CHECK(p.slots.grads_per_group == (mode == "slice" && mb > 1));
        const bool pooled = (mode == "slice" && mb == 1) || mode == "streamed";
        CHECK(p.slots.shared_grads == (pooled ? kSharedSlots : 0));
        CHECK(p.slots.tied_grads == (pooled && tied));
      }
}

TEST_CASE("program passes: evaluation's program, whole parameters", "[cpu][plan]") {
  // A forward of one batch, each segment after what its weights wait for.
  const Plan plain = tiny_plan({"optim.overlap=false"});
  CHECK(compact(make_eval_program(program_shape(plain, 0))) ==
        "begin-forward m0 | forward 0 m0 | forward 1 m0 | forward 2 m0 | forward 3 m0 | forward 4 m0 | forward 5 m0");
  const Plan overlapped = tiny_plan({});
  REQUIRE(program_shape(overlapped, 0).device_update_overlapped);
  CHECK(compact(make_eval_program(program_shape(overlapped, 0))) ==
        "begin-forward m0 | wait-update 0 m0 | forward 0 m0 | wait-update 1 m0 | forward 1 m0 | wait-update 2 m0 | "
        "forward 2 m0 | wait-update 3 m0 | forward 3 m0 | wait-update 4 m0 | forward 4 m0 | wait-update 5 m0 | "
        "forward 5 m0");
  const Plan host = tiny_plan({"optim.state_placement=host"});
  CHECK(compact(make_eval_program(program_shape(host, 0))) ==
        "begin-forward m0 | weights-ready 0 m0 | forward 0 m0 | weights-ready 1 m0 | forward 1 m0 | weights-ready 2 m0 | "
        "forward 2 m0 | weights-ready 3 m0 | forward 3 m0 | weights-ready 4 m0 | forward 4 m0 | weights-ready 5 m0 | "
        "forward 5 m0");
}

TEST_CASE("program passes: evaluation's program, sliced parameters, against the store's slots", "[cpu][plan]") {
  // The gathers one segment ahead, as in the step's forward; every segment released after its
  // forward (no backward follows), the tied embedding's after the head's.
  const Plan plan = tiny_plan({"parallel.shard=slice", "optim.overlap=false"});
  CHECK(compact(make_eval_program(program_shape(plan, 0))) ==
        "begin-forward m0 | gather 0 m0 (gathers) | join-gathers m0 | gather 1 m0 (gathers) | forward 0 m0 | "
        "release 0 m0 | join-gathers m0 | gather 2 m0 (gathers) | forward 1 m0 | release 1 m0 | join-gathers m0 | "
        "gather 3 m0 (gathers) | forward 2 m0 | release 2 m0 | join-gathers m0 | gather 4 m0 (gathers) | "
        "forward 3 m0 | release 3 m0 | join-gathers m0 | gather 5 m0 (gathers) | forward 4 m0 | release 4 m0 | "
        "join-gathers m0 | forward 5 m0 | release 5 m0");
  const Plan tied = tiny_plan({"parallel.shard=slice", "model.tie_embeddings=true", "optim.state_placement=host"});
  CHECK(compact(make_eval_program(program_shape(tied, 0))).find(
            "begin-forward m0 | weights-ready 0 m0 | gather 6 m0 (gathers) | gather 0 m0 (gathers) | join-gathers m0 | "
            "weights-ready 1 m0 | gather 1 m0 (gathers) | forward 0 m0 | release 0 m0 |") == 0);

  for (const bool with_tied : {false, true})
    for (const int mb : {1, 3})
      for (const std::string& placement : {"auto", "host"})
        for (const bool overlap : {false, true}) {
          INFO("tied " << with_tied << " micro-batches " << mb << " " << placement << " overlap " << overlap);
          const Plan q = tiny_plan({"parallel.shard=slice", "train.global_batch_size=" + std::to_string(8 * mb),
                                    std::string("model.tie_embeddings=") + (with_tied ? "true" : "false"),
                                    "optim.state_placement=" + placement,
                                    std::string("optim.overlap=") + (overlap ? "true" : "false")});
          const ProgramShape shape = program_shape(q, 0);
          const ModelLayout layout = ModelLayout::build(q.dims);
          ParamStore store = plan_store(q, layout);
          const int S = shape.segments, groups = store.num_gather_groups();
          std::vector<int> gathered(size_t(groups), 0), forwards(size_t(S), 0);
          std::vector<char> waited(size_t(S), 0);
          std::set<int> in_flight;  // gathers issued and not joined yet
          const std::vector<Action> eval = make_eval_program(shape);
          for (const Action& a : eval) {
            switch (a.kind) {
              case ActionKind::WeightsReady:
              case ActionKind::WaitUpdate: waited[size_t(a.begin)] = 1; break;
              case ActionKind::Gather: {
                const int s = a.begin == S ? 0 : a.begin;
                // The slices a gather reads are this step's: their update waited for.
                CHECK(waited[size_t(s)] == (shape.host_segments[size_t(s)] || shape.device_update_overlapped));
                store.bind_weights(a.begin);  // throws with no free slot
                in_flight.insert(a.begin);
                ++gathered[size_t(a.begin)];
                break;
              }
              case ActionKind::JoinGathers: in_flight.clear(); break;
              case ActionKind::Release: store.release_weights(a.begin); break;
              case ActionKind::Forward:
                CHECK(store.weights_bound(a.begin));
                CHECK(!in_flight.count(a.begin));
                if (with_tied && (a.begin == 0 || a.begin == S - 1)) {
                  CHECK(store.weights_bound(S));
                  CHECK(!in_flight.count(S));
                }
                ++forwards[size_t(a.begin)];
                break;
              case ActionKind::BeginForward: break;
              default: FAIL("evaluation runs " << action_name(a.kind));
            }
          }
          for (int g = 0; g < groups; ++g) CHECK(gathered[size_t(g)] == 1);
          for (int g = 0; g < groups; ++g) CHECK(!store.weights_bound(g));
          for (int s = 0; s < S; ++s) CHECK(forwards[size_t(s)] == 1);
        }
}
