// Group communicators from MPI_Comm_split of the world (see groups.h).
#include "parallel/groups.h"

#include <mpi.h>

#include "ops/ops.h"
#include "parallel/mpi_comm.h"
#include "runtime/nccl_comm.h"

namespace mop {

namespace {

// Tensor collectives on the ops device: MPI for host tensors, NCCL for GPU tensors (ordered on
// the backend's stream).
std::unique_ptr<Comm> data_comm(MPI_Comm comm, Ops& ops) {
  if (ops.device() == Device::CPU) return make_mpi_comm(comm);
  return make_nccl_comm(make_mpi_comm(comm), ops.stream());
}

MPI_Comm split(int color, int key) {
  MPI_Comm out;
  MOP_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &out) == MPI_SUCCESS, "MPI_Comm_split");
  return out;  // lives as long as the process (the comms refer to it)
}

}  // namespace

std::unique_ptr<ParallelGroups> ParallelGroups::single() {
  auto g = std::make_unique<ParallelGroups>();
  g->cp_host = make_self_comm(), g->ep_host = make_self_comm(), g->edp_host = make_self_comm();
  g->world_data = make_self_comm(), g->cp_data = make_self_comm();
  g->ep_data = make_self_comm(), g->edp_data = make_self_comm();
  return g;
}

std::unique_ptr<ParallelGroups> ParallelGroups::build(const Config& cfg, World& world, Ops& ops,
                                                      const CommStreams& streams) {
  validate_parallel(cfg, world.size);
  if (world.size == 1) {
    auto g = single();
    g->world_host = world.comm.get();
    return g;
  }
  MOP_CHECK(world.mpi, "several ranks without MPI");
  auto g = std::make_unique<ParallelGroups>();
  g->rank = world.rank, g->size = world.size;
  g->watchdog = std::make_unique<CollectiveWatchdog>(cfg.parallel.collective_timeout);
  if (cfg.parallel.collective_timeout > 0) g->watchdog->share_with_peers();
  auto watched = [&](std::unique_ptr<Comm> c) { return watch(std::move(c), *g->watchdog); };
  g->world_host_owned = watched(make_mpi_comm(MPI_COMM_WORLD));
  g->world_host = g->world_host_owned.get();
  g->cp_size = int(cfg.parallel.attention.cp), g->dp_size = int(cfg.parallel.attention.dp);
  g->ep_size = int(cfg.parallel.moe.ep), g->edp_size = int(cfg.parallel.moe.dp);
  g->cp = world.rank % g->cp_size, g->dp = world.rank / g->cp_size;
  g->ep = world.rank % g->ep_size, g->edp = world.rank / g->ep_size;
  MPI_Comm cp = split(g->dp, g->cp), ep = split(g->edp, g->ep), edp = split(g->ep, g->edp);
  g->cp_host = watched(make_mpi_comm(cp)), g->ep_host = watched(make_mpi_comm(ep));
  g->edp_host = watched(make_mpi_comm(edp));
  g->world_data = watched(data_comm(MPI_COMM_WORLD, ops));
  g->cp_data = watched(data_comm(cp, ops)), g->ep_data = watched(data_comm(ep, ops));
  g->edp_data = watched(data_comm(edp, ops));
  if (ops.device() != Device::CPU) {
    // An asynchronous comm on its own stream that follows the compute stream.
    auto side_comm = [&](MPI_Comm comm, Stream stream) {
      return watched(make_nccl_comm(make_mpi_comm(comm), stream, ops.stream()));
    };
    if (!streams.grad_sums.is_null()) {
      g->world_grad = side_comm(MPI_COMM_WORLD, streams.grad_sums);
      g->edp_grad = side_comm(edp, streams.grad_sums);
    }
    if (g->cp_size > 1 && !streams.ring.is_null()) g->cp_ring = side_comm(cp, streams.ring);
    if (g->ep_size > 1 && !streams.dispatch.is_null() && !streams.combine.is_null()) {
      g->ep_dispatch = side_comm(ep, streams.dispatch);
      g->ep_combine = side_comm(ep, streams.combine);
    }
  }
  return g;
}

}  // namespace mop
