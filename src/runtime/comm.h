// Comm: the collectives the trainer needs, over one group of ranks. Implementations: SelfComm
// (one rank, no MPI) and NcclComm (device buffers, runtime/nccl_comm.h) here beside the device
// code; in src/parallel/ MpiComm (host buffers over MPI; lets CI run multi-rank tests on CPU
// ranks) and the in-process, stand-in and timed comms. Every call is collective over the group
// (send_recv: over the ranks it pairs; send and recv: one-directional messages, not collective).
// MPI and self comms block; NCCL comms enqueue on a stream, either the compute stream (ordered
// with the kernels around them) or their own (asynchronous: join() makes the compute stream wait
// for them).
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mop {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;

  // x = Σ over ranks (in place).
  virtual void all_reduce_sum(Tensor x) = 0;
  // out [size·n] = concatenation of every rank's in [n], in rank order.
  virtual void all_gather(Tensor out, const Tensor& in) = 0;
  // out [n] = Σ over ranks of chunk `rank` of in [size·n].
  virtual void reduce_scatter_sum(Tensor out, const Tensor& in) = 0;
  // The expert exchange's counts (ExpertDispatcher::plan): an all_gather of every rank's rows per
  // expert, host I32 [size·E] from [E], for MoE layer `moe_layer` (its ordinal among the MoE
  // layers). Real comms gather; a stand-in of an emulated job answers from a routing model
  // (parallel/standin_comm.h).
  virtual void all_gather_expert_counts(Tensor out, const Tensor& in, int moe_layer) {
    (void)moe_layer;
    all_gather(out, in);
  }
  // Variable all-to-all over rows: send_counts[r] rows of `in` (consecutive, in rank order) go to
  // rank r; recv_counts[r] rows arrive from rank r into `out` in rank order. Rows have the same
  // width on every rank.
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                    const std::vector<int64_t>& send_counts);
  // The same with each rank's rows at a given row: send_counts[r] rows of `in` from row
  // send_offsets[r] go to rank r, recv_counts[r] rows from rank r land at row recv_offsets[r] of
  // `out`. The spans may come in any order and leave gaps; received spans must not overlap.
  virtual void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                            const std::vector<int64_t>& recv_offsets, const Tensor& in,
                            const std::vector<int64_t>& send_counts,
                            const std::vector<int64_t>& send_offsets) = 0;
  // Point-to-point shift (a ring step): sends `in` to rank `dst` and receives `out` (the same
  // number of bytes) from rank `src`, both at once, so every rank of a ring can call it together.
  virtual void send_recv(Tensor out, int src, const Tensor& in, int dst) = 0;

  // One-directional messages between pipeline stages. send() does not wait for its recv(): host
  // comms copy `in` before they return (the caller may reuse it at once); NCCL reads it on its own
  // stream after the compute issued before the send, so `in` stays untouched until join().
  // Messages of one (src, dst) pair arrive in the order sent; recv() takes the oldest pending
  // message from `src`, which must carry `tag` and out.bytes() bytes, else an Error naming both
  // (the mismatched message is consumed): a schedule whose sends and receives do not pair up
  // fails, it never delivers the wrong tensor. A host comm's recv() returns with `out` filled;
  // NCCL's fills it on its own stream and the compute stream waits for it at join(). Sending to or
  // receiving from this rank itself is an error. Comms without messages (a test's) refuse both.
  virtual void send(const Tensor& in, int dst, int tag);
  virtual void recv(Tensor out, int src, int tag);
  // What a message carries beside its bytes, so that recv() can check it and name it (plain data,
  // the same layout on every rank).
  struct MessageHeader {
    int64_t tag = 0, bytes = 0;
    int32_t dtype = 0, ndim = 0;
    int64_t shape[Tensor::kMaxDims] = {};
  };

  virtual void broadcast(Tensor x, int root) = 0;
  virtual void barrier() = 0;

  // Host-side reductions of a few values (metrics, token counts, agreement checks). Doubles hold
  // integers up to 2^53 exactly.
  enum class Op { Sum, Max, Min };
  virtual void all_reduce_host(double* values, int n, Op op) = 0;
  double all_reduce_host(double v, Op op) {
    all_reduce_host(&v, 1, op);
    return v;
  }
  // True on every rank when every rank passed the same string (e.g. the resolved config).
  bool all_equal(const std::string& s);
  // The compute stream waits for the collectives issued so far. Only asynchronous comms (NCCL on
  // their own stream) have anything to do; the others finish within each call. NCCL comms, also
  // those on the compute stream, run send/recv on streams of their own: join() is where the
  // compute stream waits for the messages issued so far (the sends read, the receives landed).
  virtual void join() {}

 protected:
  // Checks the arguments of all_to_all_v (one count and offset per rank, spans inside the
  // buffers, received spans disjoint, same row width); returns the bytes of one row.
  size_t check_all_to_all(const Tensor& out, const std::vector<int64_t>& recv_counts,
                          const std::vector<int64_t>& recv_offsets, const Tensor& in,
                          const std::vector<int64_t>& send_counts,
                          const std::vector<int64_t>& send_offsets) const;

  // The header of a message carrying `t` under `tag`.
  static MessageHeader message_header(const Tensor& t, int tag);
  // `peer` is another rank of the group (`call`: "send" or "recv", for the message).
  void check_message_peer(const char* call, int peer) const;
  // The oldest pending message from `src`, `got`, is the one recv(out, src, tag) asks for: the
  // same tag and byte count, else an Error naming both.
  void check_message(const MessageHeader& got, const Tensor& out, int src, int tag) const;
};

std::unique_ptr<Comm> make_self_comm();

}  // namespace mop
