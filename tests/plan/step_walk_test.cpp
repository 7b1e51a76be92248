// The step program walked against its streams' clocks (plan/step_walk.h), on hand-made programs
// with round costs whose exposed waits follow by hand: gathers one segment ahead, gradient sums on
// their own stream or on the compute stream, gradient slots waiting for their copies, and the host
// update of one step reaching into the next step's forward.
#include <vector>

#include "catch.h"
#include "plan/step_walk.h"

using namespace mop;

namespace {

constexpr double kEps = 1e-12;

ProgramShape shape(int segments, int micro_batches) {
  ProgramShape s;
  s.segments = segments, s.micro_batches = micro_batches;
  s.host_segments.assign(size_t(segments), false);
  return s;
}

WalkCosts flat(int segments, double forward, double backward) {
  WalkCosts c;
  c.forward.assign(size_t(segments), forward), c.backward.assign(size_t(segments), backward);
  return c;
}

}  // namespace

TEST_CASE("step walk: compute alone is the sum of the program's compute", "[cpu][plan]") {
  const StepProgram p = make_step_program(shape(5, 3));
  WalkCosts c = flat(5, 1, 2);
  c.zero_grads = 0.25, c.read_losses = 0.125, c.optimizer = 0.5;
  const WalkResult r = walk_step(p, c);
  CHECK(r.step == Approx(3 * 5 * (1 + 2) + 0.25 + 0.125 + 0.5).epsilon(kEps));
  CHECK(r.gathers + r.sums + r.slots + r.host + r.fetch == 0);
}

TEST_CASE("step walk: gathers run one segment ahead; a slow gather holds up each join",
          "[cpu][plan]") {
  ProgramShape s = shape(6, 1);
  s.sliced = s.pool_grads = true;
  const StepProgram p = make_step_program(s);
  for (const double g : {0.5, 1.5}) {
    INFO("gather " << g);
    WalkCosts c = flat(6, 1, 1);
    c.gather.assign(7, g);
    const WalkResult r = walk_step(p, c);
    // The forward's first gather is waited for in full; after it each gather runs beside the
    // forward of the segment before it, late by g − 1 where it is longer. The backward gathers the
    // four segments the forward released, each behind the backward of the segment after it.
    const double late = std::max(0.0, g - 1);
    CHECK(r.gathers == Approx(g + 5 * late + 4 * late).epsilon(kEps));
    CHECK(r.gather_total == Approx(10 * g).epsilon(kEps));
    CHECK(r.step == Approx(12 + r.gathers).epsilon(kEps));
  }
}

TEST_CASE("step walk: gradient sums on their stream hide behind the earlier segments' backward",
          "[cpu][plan]") {
  ProgramShape s = shape(4, 1);
  s.reduce = s.async_reduce = true;
  const StepProgram p = make_step_program(s);
  WalkCosts c = flat(4, 1, 2);
  c.reduce.assign(4, 1.5);
  WalkResult r = walk_step(p, c);
  // Each sum starts as its segment's backward ends and takes less than the next backward: only the
  // last segment's (the embedding's) is waited for at join-reduce.
  CHECK(r.sums == Approx(1.5).epsilon(kEps));
  CHECK(r.sums_total == Approx(6).epsilon(kEps));
  CHECK(r.comm_on_compute == 0);
  // On the compute stream (parallel.overlap_grad_reduce: false, or CPU ranks) all of them.
  s.async_reduce = false;
  r = walk_step(make_step_program(s), c);
  CHECK(r.comm_on_compute == Approx(6).epsilon(kEps));
  CHECK(r.step == Approx(4 * 3 + 6).epsilon(kEps));
}

TEST_CASE("step walk: sliced gradients are reduce-scattered on the compute stream", "[cpu][plan]") {
  ProgramShape s = shape(4, 1);
  s.sliced = s.pool_grads = true, s.reduce = true;
  WalkCosts c = flat(4, 1, 2);
  c.reduce_scatter.assign(5, 0.75);
  const WalkResult r = walk_step(make_step_program(s), c);
  CHECK(r.comm_on_compute == Approx(4 * 0.75).epsilon(kEps));
  CHECK(r.step == Approx(4 * 3 + 3).epsilon(kEps));
}

TEST_CASE("step walk: streamed gradients wait for a slot until its copy is done", "[cpu][plan]") {
  // Two micro-batches, every segment streamed: each backward but the last micro-batch's sends its
  // running sums out (stash), and a segment's backward takes one of two slots. A stash of 5
  // against backwards of 1: the third segment's backward waits for the first's copy.
  ProgramShape s = shape(4, 2);
  s.streamed.assign(4, true);
  WalkCosts c = flat(4, 1, 1);
  c.stash.assign(4, 5), c.fetch.assign(5, 0), c.norms.assign(4, 0);
  const WalkResult r = walk_step(make_step_program(s), c);
  CHECK(r.slots > 0);
  CHECK(r.step == Approx(2 * 4 * 2 + r.slots).epsilon(kEps));
  // Copies that fit in a segment's backward are never waited for.
  c.stash.assign(4, 0.5);
  CHECK(walk_step(make_step_program(s), c).slots == 0);
}

TEST_CASE("step walk: the host update reaches into the next step's forward", "[cpu][plan]") {
  // One micro-batch, every segment updated on the host at 1 element/s from its gradient's arrival;
  // forwards of 1 s. Segment s's update ends s + 1 elements-seconds after the step, so the next
  // step's forward of segment s (starting at s) waits 1 s for segment 0 and then runs in step.
  ProgramShape s = shape(3, 1);
  s.host_segments.assign(3, true);
  WalkCosts c = flat(3, 1, 1);
  c.to_host.assign(3, 0);
  c.host.elements.assign(3, 1);
  c.host.rate_one = c.host.rate_weights = 1, c.host.rate_state = 1e9;
  c.host.overlap = true;
  WalkResult r = walk_step(make_step_program(s), c);
  CHECK(r.host == Approx(1).epsilon(kEps));
  CHECK(r.step == Approx(6 + 1).epsilon(kEps));
  CHECK(r.host_update == Approx(3).epsilon(kEps));
  // Without overlap the step waits for the whole round.
  c.host.overlap = false;
  r = walk_step(make_step_program(s), c);
  CHECK(r.host == Approx(3).epsilon(kEps));
  CHECK_FALSE(r.two_pass);
}
