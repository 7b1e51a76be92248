// `mop emulate`: one rank of a job planned for a machine that is not here (a 96-GPU cluster), run
// on this device. The plan is made for the whole world; the rank builds exactly what it would build
// there — its slices of the weights, its optimizer state where the plan puts it, its activations and
// workspaces, its kernels at its shapes — with every collective a stand-in of the same group and
// byte counts (parallel/standin_comm.h) whose expert-exchange counts come from a routing model
// (parallel/routing_model.h). It reports, beside the plan's prediction for the same rank: device
// and host memory, compute time per category, the collectives' time by the plan's link model, and
// the step and tokens/s per GPU composed of the two.
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "ops/timed_ops.h"
#include "plan/plan.h"

namespace mop {

struct EmulateArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string machine;  // machine file; empty: as `mop plan` (this machine's GPUs' built-in, else h200)
  int gpus = 0, nodes = 0;  // as `mop plan`
  int rank = 0;
  std::string routing = "balanced";  // balanced | zipf:S | a router histogram file
  int steps = 3;   // the first is a warm-up; the report averages the others
  int layers = 0;  // > 0: emulate the rank with this many of its layers
  std::string trace;  // non-empty: a Chrome trace of the rank's last step, written here
  bool json = false;
};
int cmd_emulate(const EmulateArgs& args);

// Rank `rank` of `cfg`'s job of `world` ranks on `machine`, run here as `mop emulate` runs it
// (random tokens, balanced routing) for `steps` steps: its plan, and the compute stream's time by
// category and the step's seconds, per step, averaged over the steps after the first.
struct RankTimes {
  Plan plan;
  OpTimes times;
  double step = 0;
};
RankTimes time_rank(const Config& cfg, const Machine& machine, int world, int rank, int steps);

}  // namespace mop
