// MpiComm: Comm over an MPI communicator with host buffers (CPU ranks, and host-side agreement
// checks of GPU runs), and the comm factory of a job launched by MPI.
#pragma once

#include <mpi.h>

#include <memory>

#include "parallel/comm_factory.h"
#include "runtime/comm.h"

namespace mop {

// Wraps `comm` (not owned: MPI_COMM_WORLD or a split the caller frees).
//
// Messages (send/recv): a send copies `in`, posts a header (tag, dtype, shape, bytes) and the
// bytes with MPI_Isend and returns; the copy lives until MPI has sent it (checked at each later
// send, recv or join, waited for when the comm is destroyed). A recv takes the oldest header from
// `src` with a blocking MPI_Recv, checks it, then receives the bytes (a mismatched message's bytes
// are received and dropped, so the next message pairs up). Two ranks sending to each other at once
// cannot deadlock: no send waits. MPI orders messages per communicator and sender, so comms over
// one MPI communicator keep their messages apart by `channel` (each a pair of MPI tags): 0 for a
// comm made here directly (the World's), n + 1 for the n-th comm the factory makes of a group
// (every rank makes them in the same order).
std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm, int channel = 0);

// Comms over MPI_COMM_WORLD's ranks (MPI initialised): a group's host comms are MpiComms over one
// MPI_Comm_split of the world per group kind (the world itself for World), made when a group of
// that kind is first asked for; data comms are those too on the CPU, NCCL on a GPU.
std::unique_ptr<CommFactory> make_mpi_comm_factory();

}  // namespace mop
