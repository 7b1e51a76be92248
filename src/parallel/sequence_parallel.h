// Sequence-sharded attention (Ulysses): each of the cp ranks of a group holds S/cp tokens of every
// sequence — two chunks of S/(2cp), an early one and its mirror from the end (chunks i and
// 2cp−1−i), so the causal work is balanced. Around attention an all-to-all trades the sequence
// sharding for head sharding: every rank then holds the whole sequences for heads/cp heads, runs
// ordinary causal attention, and trades back.
//   to_full:  local [T_l, heads·D] → send rows (destination-major) → all-to-all → rows in sequence
//             order, [batch·S, heads/cp·D]
//   to_local: the exact inverse (also the backward of to_full, and vice versa)
// Both directions are a row gather, an all-to-all of equal counts and a row gather.
// SequenceSlicer cuts the whole sequences a loader reads to a rank's tokens in this layout, the one
// ring attention (ring_attention.h) expects as well.
#pragma once

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "runtime/comm.h"
#include "runtime/memory.h"

namespace mop {

// Positions (within a sequence of S) of the S/cp tokens rank cp_rank holds, in its local order.
std::vector<int> zigzag_positions(int seq, int cp_size, int cp_rank);

// The tokens rank cp_rank of a cp group keeps of micro-batches read as `batch` whole sequences of
// `seq` tokens: zigzag_positions of every sequence, in that order. With cp 1 a read lands in the
// output untouched.
class SequenceSlicer {
 public:
  SequenceSlicer(int batch, int seq, int cp_size, int cp_rank);
  // read(ids, targets, positions) writes the whole sequences ([batch, seq] each; targets −1 where
  // masked) and returns its unmasked targets. fill keeps this rank's tokens in ids, targets and
  // positions ([batch, seq/cp] each) and returns the unmasked targets among them.
  using ReadWhole = std::function<int64_t(int32_t* ids, int32_t* targets, int32_t* positions)>;
  int64_t fill(const ReadWhole& read, int32_t* ids, int32_t* targets, int32_t* positions);
  int local_seq() const { return local_seq_; }

 private:
  int batch_, seq_, local_seq_;
  std::vector<int> positions_;  // cp > 1: which positions of a sequence this rank keeps
  std::vector<int32_t> full_ids_, full_targets_, full_positions_;  // cp > 1: a read, whole
};

class UlyssesExchange {
 public:
  // batch sequences of seq (full length) tokens; max_width: the widest row exchanged
  // (heads/cp · head_dim over q, k and v) in elements of `dtype`.
  UlyssesExchange(Comm& cp, Ops& ops, int batch, int seq, int64_t max_width, DType dtype);
  // Device bytes the constructor allocates for these sizes (part of the planned memory).
  static size_t buffer_bytes(int batch, int seq, int64_t max_width, DType dtype);

  void to_full(Tensor full, const Tensor& local, int64_t heads);
  void to_local(Tensor local, const Tensor& full, int64_t heads);

 private:
  Comm& comm_;
  Ops& ops_;
  int cp_, batch_, seq_;
  int64_t local_tokens_;  // T_l = batch · seq / cp
  Buffer index_;          // device I32: pack, unpack, pack_out, unpack_out (each batch·seq)
  Buffer send_, recv_;    // [batch·seq, max_width]
  DType dtype_;
  int64_t max_width_;
  Tensor map(int which) const;
  Tensor scratch(const Buffer& b, int64_t width) const;
};

}  // namespace mop
