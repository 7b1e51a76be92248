// MpiComm: Comm over an MPI communicator with host buffers (CPU ranks, and host-side agreement
// checks of GPU runs), and the comm factory of a job launched by MPI.
#pragma once

#include <mpi.h>

#include <memory>

#include "parallel/comm_factory.h"
#include "runtime/comm.h"

namespace mop {

// Wraps `comm` (not owned: MPI_COMM_WORLD or a split the caller frees).
std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm);

// Comms over MPI_COMM_WORLD's ranks (MPI initialised): a group's host comms are MpiComms over one
// MPI_Comm_split of the world per group kind (the world itself for World), made when a group of
// that kind is first asked for; data comms are those too on the CPU, NCCL on a GPU.
std::unique_ptr<CommFactory> make_mpi_comm_factory();

}  // namespace mop
