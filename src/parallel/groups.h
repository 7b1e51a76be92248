// The two foldings of the same N ranks and a communicator per group.
//   attention: rank = dp · cp_size + cp   (cp ranks hold shards of the same sequences)
//   MoE:       rank = edp · ep_size + ep  (ep ranks hold shards of the experts)
// Dense gradients are reduced over all ranks, expert gradients over the edp group (the ranks
// holding the same experts). Host comms (MPI) carry small host-side exchanges (counts, norms);
// data comms carry tensors on the backend's device (MPI on CPU ranks, NCCL on GPUs).
#pragma once

#include <memory>
#include <vector>

#include "config/config.h"
#include "parallel/comm.h"
#include "parallel/watchdog.h"
#include "parallel/world.h"

namespace mop {

class Ops;

struct ParallelGroups {
  int rank = 0, size = 1;
  int cp = 0, cp_size = 1, dp = 0, dp_size = 1;    // attention folding
  int ep = 0, ep_size = 1, edp = 0, edp_size = 1;  // MoE folding
  // Host-side comms: the world (a watched view of World's) and the groups.
  Comm* world_host = nullptr;
  std::unique_ptr<Comm> world_host_owned, cp_host, ep_host, edp_host;
  std::unique_ptr<Comm> world_data, cp_data, ep_data, edp_data;  // tensors on the ops device
  // GPU ranks with parallel.overlap_grad_reduce: the gradient sums' own communicators (world,
  // edp), asynchronous on one stream of their own, so they overlap with backward (GradReducer).
  std::unique_ptr<Comm> world_grad, edp_grad;
  // GPU ranks with ep > 1: the expert all-to-alls' own communicators, one for the exchanges that
  // bring tokens to the experts and one for those that return them, each on its own stream
  // (ExpertDispatcher overlaps them with the experts). Null on CPU ranks (ep_data serves).
  std::unique_ptr<Comm> ep_dispatch, ep_combine;
  // GPU ranks with ring attention: the K/V ring's own communicator and stream (RingAttention
  // overlaps each step's transfers with its blocks). Null otherwise (cp_data serves).
  std::unique_ptr<Comm> cp_ring;
  std::vector<void*> side_streams;  // cudaStream_t of the asynchronous comms above, owned
  // Several ranks: every collective above is watched (parallel.collective_timeout).
  std::unique_ptr<CollectiveWatchdog> watchdog;

  // Splits the world by the config's foldings (validated against the world size). One rank (or a
  // world without MPI) gets self comms.
  static std::unique_ptr<ParallelGroups> build(const Config& cfg, World& world, Ops& ops);
  // A single-rank layout with self comms (tests, generation).
  static std::unique_ptr<ParallelGroups> single();
  ParallelGroups() = default;
  ~ParallelGroups();
  ParallelGroups(const ParallelGroups&) = delete;
  ParallelGroups& operator=(const ParallelGroups&) = delete;
};

}  // namespace mop
