// MpiComm: Comm over an MPI communicator with host buffers (CPU ranks, and host-side agreement
// checks of GPU runs).
#pragma once

#include <mpi.h>

#include <memory>

#include "parallel/comm.h"

namespace mop {

// Wraps `comm` (not owned: MPI_COMM_WORLD or a split the caller frees).
std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm);

}  // namespace mop
