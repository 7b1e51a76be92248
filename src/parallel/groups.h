// The two foldings of the same N ranks and a communicator per group.
//   attention: rank = dp · cp_size + cp   (cp ranks hold shards of the same sequences)
//   MoE:       rank = edp · ep_size + ep  (ep ranks hold shards of the experts)
// Dense gradients are reduced over all ranks, expert gradients over the edp group (the ranks
// holding the same experts). Host comms carry small host-side exchanges (counts, norms); data
// comms carry tensors on the backend's device (MPI on CPU ranks, NCCL on GPUs). The foldings are
// a Mesh's, the comms come from a CommFactory.
#pragma once

#include <memory>
#include <vector>

#include "config/config.h"
#include "parallel/comm_factory.h"
#include "parallel/mesh.h"
#include "parallel/watchdog.h"
#include "parallel/world.h"
#include "runtime/comm.h"
#include "runtime/runtime.h"

namespace mop {

class Ops;

// The streams of the asynchronous comms (the step's schedule owns them, schedule/streams.h). A
// null stream: that comm is not made, and the group's blocking data comm serves instead.
struct CommStreams {
  Stream grad_sums;  // the data-parallel gradient sums (world and edp)
  Stream ring;       // ring attention's K/V passes
  Stream dispatch, combine;  // the expert exchange, one per direction
  Stream gathers;            // sliced parameters' weight gathers (world and edp)
};

struct ParallelGroups {
  int rank = 0, size = 1;
  int cp = 0, cp_size = 1, dp = 0, dp_size = 1;    // attention folding
  int ep = 0, ep_size = 1, edp = 0, edp_size = 1;  // MoE folding
  // Host-side comms: the world (a watched view of World's) and the groups.
  Comm* world_host = nullptr;
  std::unique_ptr<Comm> world_host_owned, cp_host, ep_host, edp_host;
  std::unique_ptr<Comm> world_data, cp_data, ep_data, edp_data;  // tensors on the ops device
  // GPU ranks with a gradient-sums stream: the gradient sums' own communicators (world, edp),
  // asynchronous on that stream, so they overlap with backward (GradReducer).
  std::unique_ptr<Comm> world_grad, edp_grad;
  // GPU ranks with sliced parameters and a gathers stream: the weight gathers' own communicators
  // (world, edp), asynchronous on that stream, so a segment's gather overlaps the compute of the
  // one before it (the step program's join-gathers waits for them). Null otherwise (the data
  // comms serve).
  std::unique_ptr<Comm> world_gather, edp_gather;
  // GPU ranks with ep > 1 and exchange streams: the expert all-to-alls' own communicators, one
  // for the exchanges that bring tokens to the experts and one for those that return them, each
  // on its own stream (ExpertDispatcher overlaps them with the experts). Null on CPU ranks
  // (ep_data serves).
  std::unique_ptr<Comm> ep_dispatch, ep_combine;
  // GPU ranks with cp > 1 and a ring stream: the K/V ring's own communicator (RingAttention
  // overlaps each step's transfers with its blocks). Null otherwise (cp_data serves).
  std::unique_ptr<Comm> cp_ring;
  // Several ranks: every collective above is watched (parallel.collective_timeout).
  std::unique_ptr<CollectiveWatchdog> watchdog;

  // Splits the world by the config's foldings (validated against the world size). One rank (or a
  // world without MPI) gets self comms. GPU ranks get the asynchronous comms whose streams are
  // given, each following the compute stream (ops.stream()).
  static std::unique_ptr<ParallelGroups> build(const Config& cfg, World& world, Ops& ops,
                                               const CommStreams& streams = {});
  // The groups of `mesh` for the factory's rank, every comm from `comms`, watched with
  // `collective_timeout` (seconds; ≤ 0: no watchdog thread). Also for a world of one.
  static std::unique_ptr<ParallelGroups> build(const Mesh& mesh, CommFactory& comms,
                                               double collective_timeout, Ops& ops,
                                               const CommStreams& streams = {});
  // A single-rank layout with self comms (tests, generation).
  static std::unique_ptr<ParallelGroups> single();
  ParallelGroups() = default;
  ParallelGroups(const ParallelGroups&) = delete;
  ParallelGroups& operator=(const ParallelGroups&) = delete;
};

}  // namespace mop
