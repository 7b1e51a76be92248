// CollectiveLog: a record of every collective one rank's comms issued — which comm (the kind of
// comm and its group), which call, and its buffers' dtypes and shapes — so two runs of the same
// rank can be compared call for call (an emulated rank against the same rank of a real job). Not
// the counts of a variable all-to-all: they depend on the routing, which an emulation models.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "parallel/comm_factory.h"

namespace mop {

class CollectiveLog {
 public:
  void add(std::string entry) { entries_.push_back(std::move(entry)); }
  const std::vector<std::string>& entries() const { return entries_; }

 private:
  std::vector<std::string> entries_;  // "data ep(2) all_to_all_v bf16[96,32] ← bf16[96,32]"
};

// `inner`'s comms, each recording its calls into `log` (which must outlive them).
std::unique_ptr<CommFactory> record_collectives(std::unique_ptr<CommFactory> inner, CollectiveLog& log);

}  // namespace mop
