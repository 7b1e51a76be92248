// Plan search: every plan of a config the keys it leaves open allow — attention cp × dp (Ulysses
// or ring), experts ep × dp and the exchange's chunks, ZeRO, micro-batch size, recompute,
// optimizer-state placement — planned for a machine and world size, the ones that fit ranked by
// predicted step time, the rest kept with the reason (the memory class that overflows, or the
// setting that is not valid for this model). Keys the config sets are never changed.
#pragma once

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

SearchResult search_plans(const Config& cfg, const Machine& machine, int world);

}  // namespace mop
