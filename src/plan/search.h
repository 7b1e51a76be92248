// Plan search: every plan of a config the keys it leaves open allow — attention cp × dp (Ulysses
// or ring), experts ep × dp and the exchange's chunks, ZeRO, micro-batch size, recompute,
// optimizer-state placement — planned for a machine and world size, the ones that fit ranked by
// predicted step time, the rest kept with the reason (the memory class that overflows, or the
// setting that is not valid for this model). Keys the config sets are never changed.
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "plan/plan.h"

namespace mop {

struct Candidate {
  std::string settings;  // the chosen keys: "cp 2 ulysses, ep 2 chunks 2, mb 1, recompute, auto"
  Config cfg;
  Plan plan;             // feasible candidates only
  std::string why;       // rejected candidates: why
  std::string group;     // rejected candidates: the memory that overflows, or "invalid settings"
};

struct SearchResult {
  std::vector<Candidate> feasible;  // fastest first
  std::vector<Candidate> rejected;
  std::vector<std::string> open_keys;  // what the search chose (the keys the config leaves open)
};

// pipelines: parallel.pp (when the config leaves it open) is searched too — 1 and the stage counts
// whose stages are whole nodes (or one node's share of a smaller job), each with 1F1B and, where
// the micro-batches divide, interleaved over 2 chunks (and the fastest few of those again over 3
// and 4). Only `mop plan --search` asks for them: pipelines on GPUs have not run on more than one
// GPU yet (their messages between GPUs are untested), so train.plan: auto and the layouts mop
// plan, validate and emulate choose keep parallel.pp as the config gives it.
SearchResult search_plans(const Config& cfg, const Machine& machine, int world, bool pipelines = false);

// What would make a plan fit where none fits `world` ranks (0: nothing found): the most ranks
// below `world` and the fewest above it (whole nodes of `gpus_per_node` past one node, at most
// 64 nodes) with a plan that fits on `machine_for(ranks)`, and with `batch` (the batch did not
// divide) the nearest train.global_batch_size below and above (16 at most away) with a plan at
// `world`. Each size is tried with the memory-frugal values of the keys that only trade memory
// for time (micro-batch 1, recompute, state placement auto, exchange budget 2) where open.
struct FitAdvice {
  int fewer = 0, more = 0;
  int64_t batch_below = 0, batch_above = 0;
};
FitAdvice fit_advice(const Config& cfg, int world, int gpus_per_node, bool batch,
                     const std::function<Machine(int)>& machine_for);

}  // namespace mop
