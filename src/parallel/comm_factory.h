// CommFactory: makes this rank's comms for the groups of a mesh, whatever carries them — MPI
// processes (mpi_comm.h), threads of one process (inprocess_comm.h) or a lone rank (self comms).
// Each group gets three kinds: host comms for small host-side exchanges, data comms for tensors
// on the ops device, and GPU side comms that run on a stream of their own.
#pragma once

#include <memory>

#include "parallel/mesh.h"
#include "runtime/comm.h"
#include "runtime/runtime.h"

namespace mop {

class CollectiveWatchdog;

class CommFactory {
 public:
  virtual ~CommFactory() = default;

  // This rank's place in the world: every group asked for must hold it.
  virtual int rank() const = 0;

  // A blocking comm of host tensors over `group`. Collective over the group's members, like an
  // MPI split: each member asks for its comms in the same order as the others, and the n-th comm
  // one member makes for a group is joined with the n-th of every other member.
  virtual std::unique_ptr<Comm> host(const MeshGroup& group) = 0;

  // Tensors on `device`: on the CPU a host comm; on a GPU an NCCL comm enqueued on `compute` (the
  // ops' stream), bootstrapped through a host comm of the group that it keeps.
  virtual std::unique_ptr<Comm> data(const MeshGroup& group, Device device, Stream compute);
  // GPU only: an NCCL comm on `stream` that follows `compute` (nccl_comm.h's asynchronous comm).
  virtual std::unique_ptr<Comm> side(const MeshGroup& group, Stream stream, Stream compute);

  // Lets a firing watchdog ask the other ranks what they were doing (where the carrier supports
  // it: MPI processes); called once, before the first watched collective.
  virtual void share_watchdog(CollectiveWatchdog& dog) {}
};

// A world of one rank without MPI: self comms (NCCL ones on a GPU).
std::unique_ptr<CommFactory> make_self_comm_factory();

}  // namespace mop
