// Group communicators from MPI_Comm_split of the world (see groups.h).
#include "parallel/groups.h"

#include <mpi.h>

#include "model/sequence_parallel.h"
#include "ops/ops.h"
#include "parallel/mpi_comm.h"

#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "ops/cuda_ops.h"
#include "parallel/cuda_nccl_comm.h"
#endif

namespace mop {

namespace {

// Tensor collectives on the ops device: MPI for host tensors, NCCL for GPU tensors (ordered on
// the backend's stream).
std::unique_ptr<Comm> data_comm(MPI_Comm comm, Ops& ops) {
  if (ops.device() == Device::CPU) return make_mpi_comm(comm);
#ifdef MOP_HAVE_CUDA
  return make_nccl_comm(comm, cuda_backend(ops, "building GPU groups").stream());
#else
  MOP_UNREACHABLE("GPU ops in a CPU-only build");
#endif
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

std::unique_ptr<ParallelGroups> ParallelGroups::build(const Config& cfg, World& world, Ops& ops) {
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
#ifdef MOP_HAVE_CUDA
  if (ops.device() == Device::CUDA) {
    cudaStream_t compute = cuda_backend(ops, "building GPU groups").stream();
    // An asynchronous comm on a new stream that follows the compute stream.
    auto side_comm = [&](MPI_Comm comm, cudaStream_t& stream) {
      if (!stream) {
        MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
        g->side_streams.push_back(stream);
      }
      return watched(make_nccl_comm(comm, stream, compute));
    };
    if (cfg.parallel.overlap_grad_reduce) {
      cudaStream_t grad = nullptr;
      g->world_grad = side_comm(MPI_COMM_WORLD, grad);
      g->edp_grad = side_comm(edp, grad);
    }
    if (g->cp_size > 1 && use_ring_attention(cfg.parallel.attention.impl, cfg.model.num_heads,
                                             cfg.model.num_kv_heads, g->cp_size)) {
      cudaStream_t ring = nullptr;
      g->cp_ring = side_comm(cp, ring);
    }
    if (g->ep_size > 1) {
      cudaStream_t dispatch = nullptr, combine = nullptr;
      g->ep_dispatch = side_comm(ep, dispatch);
      g->ep_combine = side_comm(ep, combine);
    }
  }
#endif
  return g;
}

ParallelGroups::~ParallelGroups() {
  // The communicators before their streams.
  world_grad.reset(), edp_grad.reset(), ep_dispatch.reset(), ep_combine.reset(), cp_ring.reset();
#ifdef MOP_HAVE_CUDA
  for (void* s : side_streams) cudaStreamDestroy(static_cast<cudaStream_t>(s));
#endif
}

}  // namespace mop
