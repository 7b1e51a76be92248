// NcclComm: Comm over NCCL for device tensors of one group of ranks (CUDA builds only; a binary
// without CUDA refuses to make one). Every device collective is enqueued on the given stream and
// returns without waiting; barrier() and the host reductions go through a host comm of the same
// group (MPI, or a self comm for a group of one).
#pragma once

#include <memory>

#include "runtime/comm.h"
#include "runtime/runtime.h"

namespace mop {

// Collective over the group of `host` (every rank calls it): rank 0 creates the NCCL id, a
// broadcast through `host` hands it to the others, each rank joins on the *current* CUDA device
// (pick it first: one GPU per local rank). The NCCL comm has `host`'s rank and size; `host` is not
// owned and must outlive the Comm (a self comm: a group of one without MPI, a plain process on
// one GPU). `stream` is the backend's compute stream (Ops::stream()), so collectives are ordered
// with the kernels around them without host syncs.
//
// Semantics are those of runtime/comm.h with device buffers, plus:
//   all_reduce_sum, reduce_scatter_sum  F32, BF16, F64, I32, I64 (BF16 is summed in bf16 by NCCL);
//   all_gather, broadcast, all_to_all_v any dtype (moved as bytes); all_to_all_v needs distinct
//                                       `in` and `out` buffers;
//   barrier                             waits for this rank's stream, checks the communicator for
//                                       asynchronous errors, then the host comm's barrier;
//   all_reduce_host                     host doubles through the host comm (no device work, no
//                                       stream sync).
//
// Asynchronous comm: with `follow` (the compute stream) given and different from `stream`, every
// device collective first waits for the work issued on `follow` so far, then runs on `stream`
// alongside the compute that follows; join() makes `follow` wait for the collectives issued so
// far. The caller keeps the buffers of a collective untouched until it has joined.
std::unique_ptr<Comm> make_nccl_comm(Comm& host, Stream stream, Stream follow = Stream());
// The same, keeping `host` as long as the result lives.
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, Stream stream, Stream follow = Stream());

}  // namespace mop
