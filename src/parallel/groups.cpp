// Group communicators from a mesh and a comm factory (see groups.h).
#include "parallel/groups.h"

#include "ops/ops.h"

namespace mop {

std::unique_ptr<ParallelGroups> ParallelGroups::single() {
  auto g = std::make_unique<ParallelGroups>();
  g->cp_host = make_self_comm(), g->ep_host = make_self_comm(), g->edp_host = make_self_comm();
  g->world_data = make_self_comm(), g->cp_data = make_self_comm();
  g->ep_data = make_self_comm(), g->edp_data = make_self_comm();
  return g;
}

std::unique_ptr<ParallelGroups> ParallelGroups::build(const Config& cfg, World& world, Ops& ops,
                                                      const CommStreams& streams) {
  const Mesh mesh = Mesh::of(cfg, world.size);
  if (world.size == 1) {
    auto g = single();
    g->world_host = world.comm.get();
    return g;
  }
  MOP_CHECK(world.mpi || world.inprocess || world.standin, "several ranks without MPI");
  std::unique_ptr<CommFactory> comms = make_comm_factory(world);
  MOP_CHECK(comms->rank() == world.rank, "world rank ", world.rank, ", MPI rank ", comms->rank());
  return build(mesh, *comms, cfg.parallel.collective_timeout, ops, streams);
}

std::unique_ptr<ParallelGroups> ParallelGroups::build(const Mesh& mesh, CommFactory& comms,
                                                      double collective_timeout, Ops& ops,
                                                      const CommStreams& streams) {
  auto g = std::make_unique<ParallelGroups>();
  g->rank = comms.rank(), g->size = mesh.world_size();
  g->watchdog = std::make_unique<CollectiveWatchdog>(collective_timeout);
  if (collective_timeout > 0) comms.share_watchdog(*g->watchdog);
  auto watched = [&](std::unique_ptr<Comm> c) { return watch(std::move(c), *g->watchdog); };
  const MeshGroup world = mesh.group(GroupKind::World, g->rank);
  const MeshGroup cp = mesh.group(GroupKind::Cp, g->rank), ep = mesh.group(GroupKind::Ep, g->rank);
  const MeshGroup edp = mesh.group(GroupKind::Edp, g->rank);
  g->world_host_owned = watched(comms.host(world));
  g->world_host = g->world_host_owned.get();
  g->cp_size = mesh.dims().cp, g->dp_size = mesh.dims().dp;
  g->ep_size = mesh.dims().ep, g->edp_size = mesh.dims().edp;
  const AttentionCoord a = mesh.attention(g->rank);
  const MoeCoord m = mesh.moe(g->rank);
  g->cp = a.cp, g->dp = a.dp, g->ep = m.ep, g->edp = m.edp;
  // The order in which the comms are made is part of the protocol: every rank makes them alike.
  g->cp_host = watched(comms.host(cp)), g->ep_host = watched(comms.host(ep));
  g->edp_host = watched(comms.host(edp));
  auto data = [&](const MeshGroup& group) {
    return watched(comms.data(group, ops.device(), ops.stream()));
  };
  g->world_data = data(world), g->cp_data = data(cp), g->ep_data = data(ep),
  g->edp_data = data(edp);
  if (ops.device() != Device::CPU) {
    // An asynchronous comm on its own stream that follows the compute stream.
    auto side = [&](const MeshGroup& group, Stream stream) {
      return watched(comms.side(group, stream, ops.stream()));
    };
    if (!streams.grad_sums.is_null()) {
      g->world_grad = side(world, streams.grad_sums);
      g->edp_grad = side(edp, streams.grad_sums);
    }
    if (!streams.gathers.is_null()) {
      g->world_gather = side(world, streams.gathers);
      g->edp_gather = side(edp, streams.gathers);
    }
    if (g->cp_size > 1 && !streams.ring.is_null()) g->cp_ring = side(cp, streams.ring);
    if (g->ep_size > 1 && !streams.dispatch.is_null() && !streams.combine.is_null()) {
      g->ep_dispatch = side(ep, streams.dispatch);
      g->ep_combine = side(ep, streams.combine);
    }
  }
  return g;
}

}  // namespace mop
