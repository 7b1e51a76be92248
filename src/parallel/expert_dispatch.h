// ExpertDispatcher: moves expert-ordered token rows between the ranks of an expert-parallel group
// and runs this rank's experts on them (dropless: every row reaches its expert's owner). Each rank
// owns experts [ep_rank·E_local, (ep_rank+1)·E_local). Per MoE layer and micro-batch:
//   plan(counts)   rows per global expert on this rank → an all-to-all of counts tells every owner
//                  how many rows of each of its experts come from each source rank
//   run(...)       dispatch → experts → combine, chunk by chunk
//
// Chunks: the rank's experts are cut into `chunks` contiguous ranges (at most E_local). A chunk's
// rows travel in one all-to-all (dispatch), are gathered into expert-major order, go through the
// experts (a callback), are gathered back into source order and return in another all-to-all
// (combine). With asynchronous comms (GPU ranks: own NCCL communicators and streams, groups.h)
// chunk c+1's dispatch and chunk c-1's combine run while chunk c's experts compute; with
// blocking comms (MPI) the same steps run in turn. The experts see the same rows either way, so
// the results do not depend on the chunking.
//
// Rounds (a bounded exchange): the receive buffers hold max_rows_in rows (B), fewer than the worst
// case ep × T × top_k. A rank whose experts receive more takes them in rounds: round r is rows
// [r·B, min((r+1)·B, rows_in)) of its local layout. A source's rows for one receiver lie in one
// contiguous span of its expert-ordered rows (the receiver's experts in order, each in the
// source's order), so each round is one all-to-all of one span per peer. plan() all-gathers every
// rank's counts, so every rank computes every receiver's rounds; the number of rounds is the most
// any rank needs, and every rank takes part in each (with no rows where it has none). With
// several rounds the chunks are the rounds, run one after another; a round may cut an expert's
// rows in two (its grouped GEMMs see part of them in each round). With one round, the pipelined
// expert chunks above.
//
// Local row layout: expert-major over this rank's experts, then source rank, then the source's
// order; chunk c is rows [row0, row0+rows) of x_local, y_local and the callers' per-row buffers,
// which hold the whole layout with one round and one round's rows (from row 0) with several.
#pragma once

#include <functional>
#include <vector>

#include "ops/ops.h"
#include "runtime/comm.h"
#include "runtime/memory.h"

namespace mop {

class ExpertDispatcher {
 public:
  // data: tensor comm of the ep group on the ops device; host: the same group for counts.
  // dispatch/combine: asynchronous comms of the group for the two directions, or null (data
  // serves, blocking). max_rows_in: the rows this rank's receive buffers hold (dropless worst
  // case: ep_size × its own maximum; less: rounds).
  ExpertDispatcher(Comm& data, Comm& host, Ops& ops, int64_t num_experts, int64_t max_rows_in,
                   int chunks = 1, Comm* dispatch = nullptr, Comm* combine = nullptr);

  // The memory a dispatcher allocates: device index maps and their host staging (pinned next to
  // a GPU).
  struct Footprint {
    size_t device_bytes = 0, host_bytes = 0;
  };
  static Footprint footprint(int64_t num_experts, int ep_size, int64_t max_rows_in, int chunks);

  // counts: host I32 [num_experts], this rank's rows per expert in MoE layer `moe_layer` (its
  // ordinal among the MoE layers: an emulated job's stand-in routes by layer).
  void plan(const int32_t* counts, int moe_layer = 0);
  int64_t rows_out() const { return rows_out_; }  // rows this rank sends (Σ counts)
  int64_t rows_in() const { return rows_in_; }    // rows it receives for its experts
  // Rows of x_local, y_local (and the callers' per-row buffers) in use: rows_in with one round,
  // max_rows_in with several.
  int64_t rows_held() const { return rounds_ > 1 ? max_rows_in_ : rows_in_; }
  int num_rounds() const { return rounds_; }  // the same on every rank of the group
  int num_chunks() const { return rounds_ > 1 ? rounds_ : chunks_; }  // expert chunks, or rounds

  struct Chunk {
    int64_t e0, e1;      // local experts [e0, e1) (a round: those with rows in it)
    int64_t row0, rows;  // rows [row0, row0 + rows) of x_local and y_local
    Tensor offsets;      // host I32 [e1 - e0 + 1]: the experts' rows, from 0 (grouped GEMMs)
  };
  Chunk chunk(int c) const;

  // in [rows_out, W]: this rank's rows in expert order over all E; out [rows_out, W]: the
  // experts' results back in that order. x_local [rows_held, W] receives the rows of this rank's
  // experts (local layout); experts(chunk) must write y_local [rows_held, W]'s rows of the chunk
  // from x_local's (and whatever it keeps per row). scratch: [max_rows_in, W], same dtype.
  // Forward: in = permuted tokens, out = expert outputs. Backward: in = output gradients,
  // out = input gradients (dispatch and combine are each other's transpose).
  // with (optional, [rows_out, W]) travels alongside `in` into with_local [rows_held, W] (the
  // forward's input rows, for a backward in rounds to recompute from).
  void run(const Tensor& in, Tensor out, Tensor x_local, Tensor y_local, Tensor scratch,
           const std::function<void(const Chunk&)>& experts, const Tensor* with = nullptr,
           Tensor with_local = {});

 private:
  // Chunk c's exchange with each peer r: to_peer[r] rows of r's experts from row global_at[r]
  // of `in` (dispatch; combine returns them to `out` there), from_peer[r] rows of my experts from
  // r at row scratch_at[r] of scratch (source-major within the chunk's rows).
  struct Spans {
    std::vector<int64_t> to_peer, from_peer, global_at, scratch_at;
  };
  Spans spans(int c) const;
  // Chunk c of receiver q: rows [begin(q, c), begin(q, c + 1)) of q's local layout.
  int64_t begin(int q, int c) const;
  // Rows of source s for receiver q's experts that precede row `row` of q's local layout.
  int64_t before(int q, int s, int64_t row) const;
  // Chunk c's index maps between the order its rows arrive in (source-major) and the experts'
  // order, relative to the chunk: to_expert[i] = arrival row of expert-major row i, and back.
  void chunk_maps(int c, int32_t* to_expert, int32_t* to_source) const;
  void upload_maps(int64_t row0, int64_t rows);  // the staged maps' rows [row0, row0 + rows)

  Comm& data_;
  Comm& host_;
  Comm* dispatch_;
  Comm* combine_;
  Ops& ops_;
  int size_, rank_, chunks_, rounds_ = 1;
  int64_t experts_, local_experts_, max_rows_in_;
  int64_t rows_out_ = 0, rows_in_ = 0;
  std::vector<int64_t> chunk_e0_;        // [chunks + 1]: first local expert of each expert chunk
  std::vector<int64_t> global_offsets_;  // [E + 1]: this rank's rows per global expert, cumulated
  std::vector<int32_t> all_counts_;      // [source][global expert]: every rank's counts
  std::vector<int64_t> layout_offsets_;  // [receiver][local expert + 1]: its local layout
  std::vector<int64_t> starts_;          // [receiver][local expert][source]: first row of the block
  // This rank's chunks (expert chunks or rounds): experts, rows, offsets at offsets_at_.
  std::vector<int64_t> piece_e0_, piece_e1_, piece_row0_, piece_rows_;
  std::vector<size_t> offsets_at_;
  std::vector<int32_t> piece_offsets_;
  Buffer host_buf_;   // host staging of the index maps: to_expert [max_rows_in], to_source [same]
  Buffer index_dev_;  // device I32: to_expert_major [max_rows_in], to_source_major [max_rows_in]
};

}  // namespace mop
