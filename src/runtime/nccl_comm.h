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
//
// Messages (send/recv, comm.h): NCCL runs the operations of one communicator one after another,
// whatever their streams, and a send waits on the GPU for its receive, so a send and a receive on
// one communicator would block each other (two neighbours sending to each other at once, as a
// pipeline's steady phase does, would deadlock). Each direction between two ranks is therefore a
// lane of its own: a two-rank NCCL communicator and a stream, made when the two ranks first
// exchange a message in either direction (both lanes of the pair at once; each rank waits on the
// host for the other's first message with it). A message's operation starts on its lane after the
// compute issued before it; join() makes the compute stream (the followed one, or `stream` itself
// for a comm on the compute stream) wait for every message issued since: only then may a sent
// tensor be overwritten or a received one read. A send issues at once; a recv waits on the host
// for the message's header (tag, dtype, shape, bytes), which the sender passes through the host
// comm, checks it (comm.h's error on a mismatch) and issues. The order of one lane is FIFO. Avoid
// joining between a send and a receive the peer needs before it receives: the join waits on the
// GPU for the send's receive.
std::unique_ptr<Comm> make_nccl_comm(Comm& host, Stream stream, Stream follow = Stream());
// The same, keeping `host` as long as the result lives.
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, Stream stream, Stream follow = Stream());

}  // namespace mop
