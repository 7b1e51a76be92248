// Causal attention over query tiles, for long sequences on one rank (cp = 1, or Ulysses' whole
// sequences). A sequence of S tokens is cut into n = S / tile tiles of c tokens; query tile i sees
// key tiles 0..i: j < i in full c×c blocks, j = i in a causal one. Forward merges a tile's blocks
// by their log-sum-exp (attention_merge, in the order j = 0..i) into an acc-dtype accumulator of
// one tile; backward passes every block the tile's final output, dout and lse, so each call yields
// the block's exact share of dq, dk, dv, which are summed in the acc dtype (dq over one tile,
// dk/dv over the sequence). The backend's workspace, and every buffer here but the dK/dV sums
// (2·S·Nkv·D acc), is then bounded by the tile instead of the sequence.
//
// The lse of a tiled call is laid out tile by tile: for sequence b and tile i, the block
// [Nq, c] at element (b·S + i·c)·Nq (what attention_fwd writes for a one-tile call, so a tile of
// the whole sequence is the untiled layout). Forward and backward of one plan agree on it; nothing
// else reads lse.
//
// The dK/dV sums may live in a buffer the caller lends to backward (the model lends its dln, dead
// while attention's backward runs): sums_fit(bytes) says whether one of that size holds them, and
// a TiledAttention built with lend_sums allocates none of its own.
//
// tile 0, or a tile of at least S: one call per pass, the plain op (nothing allocated); so are
// sequences that are not a multiple of the tile.
#pragma once

#include <cstddef>
#include <cstdint>

#include "ops/ops.h"
#include "runtime/memory.h"

namespace mop {

class TiledAttention {
 public:
  // Sequences of up to max_seq tokens (a multiple of `tile` when tiled); q has num_q_heads, k/v
  // num_kv_heads of head_dim; dtype: the compute dtype.
  TiledAttention(Ops& ops, int64_t tile, int64_t max_seq, int64_t num_q_heads,
                 int64_t num_kv_heads, int64_t head_dim, DType dtype, bool lend_sums = false);

  // Whether sequences of `seq` tokens run in tiles of `tile`.
  static bool tiled(int64_t tile, int64_t seq) { return tile > 0 && tile < seq; }
  // Bytes the constructor allocates on the ops device (0 untiled): part of the planned memory.
  static size_t buffer_bytes(int64_t tile, int64_t max_seq, int64_t num_q_heads,
                             int64_t num_kv_heads, int64_t head_dim, DType dtype,
                             bool lend_sums = false);
  // Whether `bytes` hold the dK/dV sums of one sequence of max_seq tokens.
  static bool sums_fit(size_t bytes, int64_t max_seq, int64_t num_kv_heads, int64_t head_dim,
                       DType dtype);
  // Attention calls of one forward (n(n+1)/2 per sequence; backward the same) of `seq` tokens.
  static int64_t calls_per_sequence(int64_t tile, int64_t seq);

  // q [T,Nq,D], k/v [T,Nkv,D], out [T,Nq,D], lse acc [T·Nq] (layout above); T = batch·seq.
  // rows < T (one tiled sequence, a multiple of the tile): only the query tiles of the first
  // `rows` tokens (a recompute whose later tiles were kept); the rest of out and lse is untouched.
  void forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
               int batch, float scale, int64_t rows = -1);
  // dq, dk, dv (overwritten) from dout and the forward's q, k, v, out and lse. lent: scratch for
  // the dK/dV sums (built with lend_sums; its contents are overwritten), else unused. dq may be
  // dout itself (a tile's dq is written once its dout has been read for the last time) wherever
  // this object has a tile: a sequence of at most one tile then goes through the tile's buffers.
  void backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse, int batch,
                float scale, Tensor lent = Tensor());

  int64_t tile() const { return tile_; }

 private:
  // Whether a call of these sequences runs in tiles (longer than a tile and a multiple of it;
  // shorter or other lengths, e.g. a scoring run's, take the plain op).
  bool runs_tiled(const Tensor& q, int batch) const;
  // Checks a call's shapes; returns the tokens per sequence.
  int64_t check(const Tensor& q, const Tensor& k, const Tensor& lse, int batch, const char* op) const;
  // lse block of sequence b's tile starting at row s0 (c rows): [1, Nq, c].
  Tensor lse_tile(const Tensor& lse, int64_t seq, int64_t b, int64_t s0) const;
  // backward of sequences no longer than a tile whose dq is dout (through the tile's buffers).
  void backward_short(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                      const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                      int batch, float scale);
  // acc += part (part in the compute dtype, acc in the acc dtype).
  void accumulate(Tensor acc, const Tensor& part);
  Tensor at(size_t offset, DType dtype, std::initializer_list<int64_t> dims) const;

  Ops& ops_;
  int64_t tile_, max_seq_, nq_, nkv_, dim_;
  bool lend_sums_;
  DType cdt_, adt_;
  Buffer buffer_;
  // Byte offsets into buffer_ (see buffer_bytes).
  size_t acc_ = 0, part_q_ = 0, part_lse_ = 0, part_dk_ = 0, part_dv_ = 0, sum_dk_ = 0, sum_dv_ = 0,
         conv_ = 0;
};

}  // namespace mop
