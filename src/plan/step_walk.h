// The step program (plan/program.h) walked against the clocks of the streams it names — the same
// program the schedule runs, action by action, so the time model does not restate the schedule:
// the compute stream runs each segment's forward and backward (priced from the model's ops by the
// time model) and the compute-stream actions; gathers, gradient sums and copies to the host start
// on their streams once the compute issued before them is done; a slot for in-flight gradients is
// taken when one is free (the store's choice: the one freed longest ago), freed when its copies
// end; the host engine updates the segments in forward order as their gradients arrive, and the
// next step's forward waits for each segment's weights. What the compute stream waits for is
// exposed. One step's update reaches into the next: the walk repeats the step until it is steady.
// Pipeline stages walk together: a rank's receive waits for the neighbour's send.
#pragma once

#include <vector>

#include "plan/program.h"

namespace mop {

// The host AdamW engine: per segment the state elements this rank updates there, and its rates
// (elements/s) for one pass, the weights pass and the state pass of the two-pass mode.
struct HostUpdateCosts {
  std::vector<double> elements;
  double rate_one = 0, rate_weights = 0, rate_state = 0;
  bool overlap = true;  // optim.overlap: the update runs beside the next step
  double total() const;
};

// Seconds of every action of the program, by segment or gather group.
struct WalkCosts {
  std::vector<double> forward, backward;  // per segment, one micro-batch (compute stream)
  double zero_grads = 0, read_losses = 0, optimizer = 0, broadcast = 0;  // compute stream
  std::vector<double> norms;           // per segment: grad-norms (compute stream)
  std::vector<double> reduce;          // per segment: reduce-grads (on the action's stream)
  std::vector<double> gather;          // per gather group: gather (gathers stream)
  std::vector<double> reduce_scatter;  // per gather group: reduce-scatter (compute stream)
  std::vector<double> stash;           // per segment: stash-grads (host-copy stream)
  std::vector<double> fetch;           // per segment: a running sum back for a later grad-slot
  std::vector<double> to_host;         // per segment: grads-to-host (host-copy stream)
  std::vector<double> device_update;   // per segment: device-update (see step_walk.cpp)
  double message = 0;  // pipeline stages: one micro-batch's activation or gradient to a neighbour
  HostUpdateCosts host;
};

// A message between pipeline ranks: micro-batch m's activation (or its gradient) at the boundary
// before segment `boundary`, what a send-act / send-grad sends and a recv-act / recv-grad takes.
struct PipeMessage {
  bool grad = false;
  int micro_batch = 0, boundary = 0;
  auto operator<=>(const PipeMessage&) const = default;
};
PipeMessage pipe_message(const Action& a);

// The steady step: its end on the compute stream and what the compute stream waited for.
struct WalkResult {
  double step = 0;
  double gathers = 0;          // join-gathers: gathers not done when joined
  double sums = 0;             // join-reduce: gradient sums not done when joined
  double slots = 0;            // grad-slot: no gradient slot free yet
  double fetch = 0;            // running sums coming back (compute stream)
  double host = 0;             // weights-ready, the host's previous round: the host update
  double comm_on_compute = 0;  // gradient sums and reduce-scatters issued on the compute stream
  double pipeline = 0;         // recv-act, recv-grad: waiting for a neighbouring stage (the bubble)
  double losses_wait = 0;      // read-losses: waiting for the other pipeline ranks
  double messages_total = 0;   // every send of the pipeline's (hidden or not)
  double gather_total = 0, sums_total = 0;  // every gather, every sum (hidden or not)
  bool two_pass = false;                    // the host update in two passes (the faster mode)
  double host_update = 0, host_state = 0;   // the host round: until the new weights, the state pass
};

WalkResult walk_step(const StepProgram& program, const WalkCosts& costs);

// The ranks of a pipeline (one program and its costs per pipeline rank) walked together: a receive
// waits for its message, which the neighbour's send puts on its pipe stream; the losses are read
// on every rank at once (their sum over the ranks). One result per rank; each one's step ends
// where that rank's ends (the slowest is the step's).
std::vector<WalkResult> walk_pipeline(const std::vector<StepProgram>& programs,
                                      const std::vector<WalkCosts>& costs);

}  // namespace mop
