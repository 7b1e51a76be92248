// Stand-in comms: the collectives of one rank of an emulated job (`mop emulate`), which runs rank
// R of an N-rank job alone on this device. Each comm has its group's rank, size, buffers and byte
// counts, and fills what it "receives" with this rank's own data, so the step runs as rank R's
// would; no other rank exists and nothing crosses a link (the plan's link model prices that).
//   all_gather          every chunk of `out` ← `in`
//   reduce_scatter_sum  out ← this rank's chunk of `in`
//   all_reduce_sum, broadcast, barrier: leave the tensor as it is (every rank alike)
//   all_to_all_v        each received span ← rows of `in` from its first row on, repeated as needed
//   send_recv           out ← in
//   send                nothing (no peer exists; the peer must be another rank of the group)
//   recv                nothing arrives: `out` keeps what it held, as all_reduce_sum's tensor
//   all_reduce_host     Sum: × size (every rank contributes what this one does); Max, Min: as is
//   all_gather_expert_counts  this rank's counts as given; every other rank's from `expert_counts`
//                       (the routing model), so the experts receive what that model sends them
// Device buffers are copied on the comm's stream (asynchronous comms follow the compute stream
// and join() waits for them, as NCCL's do), host buffers at once.
#pragma once

#include <functional>
#include <memory>

#include "parallel/comm_factory.h"
#include "parallel/world.h"

namespace mop {

// The rows rank `source` of the ep group sends to each of the `experts` experts (out[e]) in MoE
// layer `moe_layer`, when this rank sends `rows` rows in all (tokens × top_k): Σ out = rows.
using ExpertCountsFn =
    std::function<void(int moe_layer, int source, int64_t rows, int64_t experts, int32_t* out)>;

// Rank `rank` of an emulated job of `size` ranks.
struct StandInJob {
  int rank = 0, size = 1;
  ExpertCountsFn expert_counts;  // null: every rank sends what this one does
};

std::unique_ptr<CommFactory> make_standin_comm_factory(std::shared_ptr<const StandInJob> job);

// The World of an emulated rank: rank job.rank of job.size, `ranks_per_node` to a node (its local
// rank and size), a stand-in world comm; its groups' comms are stand-ins (make_comm_factory).
World standin_world(std::shared_ptr<const StandInJob> job, int ranks_per_node);

}  // namespace mop
