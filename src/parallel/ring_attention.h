// Ring attention over the cp ranks of a sequence-parallel group, for any head count (Ulysses needs
// the heads to divide by cp, see sequence_parallel.h). Rank r holds chunks r and 2cp−1−r (c tokens
// each) of every sequence, local order [early ; late]. Its q stays put; the K/V of the cp ranks
// travel around the ring (r−1 → r → r+1), so at step s rank r holds the K/V of rank j = r − s.
// Per sequence the chunk pairs are
//   (q early r,        kv early j):        causal if j = r, full if j < r, none if j > r
//   (q late 2cp−1−r,   kv early j):        always full
//   (q late 2cp−1−r,   kv late 2cp−1−j):   causal if j = r, full if j > r, none if j < r
//   (q early r,        kv late 2cp−1−j):   never (a late chunk lies after every early one)
// so every step j ≠ r costs each rank exactly two full c×c blocks. Each block is one attention call
// (batch 1) whose output and log-sum-exp are merged into fp32 (acc dtype) accumulators.
// Backward (the standard ring backward): K/V travel the same way, and so do the acc-dtype dK/dV
// sums of their owner, one step behind: at each step a rank sums its blocks' share of the K/V it
// holds while the share of the ranks before it arrives, adds the two, and sends the total on during
// the next step. Every block's attention_bwd gets the block's q, k, v and the final output, dout
// and lse, so the softmax is recomputed with the global normaliser and the call yields the block's
// exact share of dq, dk, dv. After the last step one more shift brings every dK/dV sum home.
// With an asynchronous comm (GPU ranks) each step's transfers run while its blocks compute; a
// blocking one moves them first. All buffers are allocated once, in the constructor
// (buffer_bytes() plans them).
#pragma once

#include "ops/ops.h"
#include "runtime/comm.h"
#include "runtime/memory.h"

namespace mop {

class RingAttention {
 public:
  // Up to max_batch sequences of max_local_seq tokens on this rank (two chunks of max_local_seq/2);
  // q has num_q_heads, k/v num_kv_heads of head_dim; dtype: the compute dtype.
  // async: an asynchronous comm of the same group (groups.h), or null (cp serves, blocking).
  RingAttention(Comm& cp, Ops& ops, int max_batch, int max_local_seq, int64_t num_q_heads,
                int64_t num_kv_heads, int64_t head_dim, DType dtype, Comm* async = nullptr);

  // Device bytes the constructor allocates for these sizes (part of the planned memory).
  static size_t buffer_bytes(int max_batch, int max_local_seq, int64_t num_q_heads,
                             int64_t num_kv_heads, int64_t head_dim, DType dtype);

  // q [T_l,Nq,D], k/v [T_l,Nkv,D] (T_l = batch·local_seq) in this rank's local order; out
  // [T_l,Nq,D]. lse acc [2·batch, Nq, c]: one [Nq, c] block per (sequence, chunk), the log-sum-exp
  // over every key the chunk's queries see — kept for backward.
  void forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v, int batch,
               float scale);
  // dq, dk, dv (overwritten) from dout and the forward's q, k, v, out and lse.
  void backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, int batch,
                float scale);

 private:
  // One block of one sequence: query chunk q_late (0 early, 1 late) against key chunk kv_late.
  struct Block {
    int q_late, kv_late;
    bool causal;
  };
  // The blocks of a step whose K/V come from rank j (see the table above): 2 or 3 per sequence.
  int blocks_of(int j, Block* out) const;
  // Views of packet p: k and v [T_l,Nkv,D] (compute dtype), and the packet's bytes (send_recv).
  Tensor packet_kv(int p, int which, int64_t tokens) const;
  Tensor packet(int p, int64_t tokens) const;
  // Views of dK/dV sum buffer i: dk and dv [T_l,Nkv,D] (acc dtype), and its bytes.
  Tensor sum_dkv(int i, int which, int64_t tokens) const;
  Tensor sum(int i, int64_t tokens) const;
  // acc += part (part in the compute dtype, acc in the acc dtype; same number of elements).
  void accumulate(Tensor acc, const Tensor& part);
  // Checks a call's shapes against the plan; returns lse as its blocks [2·batch, Nq, c].
  Tensor check(const Tensor& q, const Tensor& k, const Tensor& lse, int batch, const char* op) const;

  Comm& comm_;
  Ops& ops_;
  int cp_, rank_, max_batch_, max_local_seq_;
  int64_t nq_, nkv_, dim_;
  DType cdt_, adt_;
  Buffer buffer_;
  // Byte offsets into buffer_ (see buffer_bytes): two packets, three sums, the acc [T_l,Nq,D] accumulator
  // (forward: out, backward: dq), block scratch (compute: o / dq [c,Nq,D], dk and dv [c,Nkv,D];
  // acc: lse [Nq,c] and a conversion row block [c, max(Nq,Nkv)·D]).
  size_t packet_bytes_ = 0, sum_bytes_ = 0, sums_off_ = 0, acc_off_ = 0, part_o_off_ = 0, part_dk_off_ = 0, part_dv_off_ = 0;
  size_t part_lse_off_ = 0, conv_off_ = 0;
  Tensor at(size_t offset, DType dtype, std::initializer_list<int64_t> dims) const;
};

}  // namespace mop
