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
// Local row layout (x_local, y_local and the callers' per-row buffers): expert-major over this
// rank's experts, then source rank, then the source's order; chunk c is rows [row0, row0+rows).
#pragma once

#include <functional>
#include <vector>

#include "core/memory.h"
#include "ops/ops.h"
#include "parallel/comm.h"

namespace mop {

class ExpertDispatcher {
 public:
  // data: tensor comm of the ep group on the ops device; host: the same group for counts.
  // dispatch/combine: asynchronous comms of the group for the two directions, or null (data
  // serves, blocking). max_rows_in: the most rows this rank can receive (ep_size × its own
  // maximum: dropless).
  ExpertDispatcher(Comm& data, Comm& host, Ops& ops, int64_t num_experts, int64_t max_rows_in,
                   int chunks = 1, Comm* dispatch = nullptr, Comm* combine = nullptr);

  // The memory a dispatcher allocates: device index maps and host offsets (pinned next to a GPU).
  struct Footprint {
    size_t device_bytes = 0, host_bytes = 0;
  };
  static Footprint footprint(int64_t num_experts, int ep_size, int64_t max_rows_in, int chunks);

  void plan(const int32_t* counts);  // host I32 [num_experts]: this rank's rows per expert
  int64_t rows_out() const { return rows_out_; }  // rows this rank sends (Σ counts)
  int64_t rows_in() const { return rows_in_; }    // rows it receives for its experts
  int num_chunks() const { return chunks_; }

  struct Chunk {
    int64_t e0, e1;      // local experts [e0, e1)
    int64_t row0, rows;  // rows [row0, row0 + rows) of the local layout
    Tensor offsets;      // host I32 [e1 - e0 + 1]: the experts' rows, from 0 (grouped GEMMs)
  };
  Chunk chunk(int c) const;

  // in [rows_out, W]: this rank's rows in expert order over all E; out [rows_out, W]: the
  // experts' results back in that order. x_local [rows_in, W] receives the rows of this rank's
  // experts (local layout); experts(chunk) must write y_local [rows_in, W]'s rows of the chunk
  // from x_local's (and whatever it keeps per row). scratch: [max_rows_in, W], same dtype.
  // Forward: in = permuted tokens, out = expert outputs. Backward: in = output gradients,
  // out = input gradients (dispatch and combine are each other's transpose).
  void run(const Tensor& in, Tensor out, Tensor x_local, Tensor y_local, Tensor scratch,
           const std::function<void(const Chunk&)>& experts);

 private:
  // Chunk c's exchange with each peer r: to_peer[r] rows of r's experts from row global_at[r]
  // of `in` (dispatch; combine returns them to `out` there), from_peer[r] rows of my experts from
  // r at row scratch_at[r] of scratch (source-major within the chunk's rows).
  struct Spans {
    std::vector<int64_t> to_peer, from_peer, global_at, scratch_at;
  };
  Spans spans(int c) const;

  Comm& data_;
  Comm& host_;
  Comm* dispatch_;
  Comm* combine_;
  Ops& ops_;
  int size_, rank_, chunks_;
  int64_t experts_, local_experts_, max_rows_in_;
  int64_t rows_out_ = 0, rows_in_ = 0;
  std::vector<int64_t> chunk_e0_;               // [chunks + 1]: first local expert of each chunk
  std::vector<int64_t> global_offsets_;         // [E + 1]: this rank's rows per global expert, cumulated
  std::vector<int32_t> recv_counts_;            // [source][local expert]
  Buffer host_buf_;      // host: local offsets, per-chunk offsets, the two index maps before upload
  Tensor local_offsets_;
  int32_t* chunk_offsets_ = nullptr;  // [E_local + chunks]: each chunk's offsets from 0
  Buffer index_dev_;     // device I32: to_expert_major [max_rows_in], to_source_major [max_rows_in]
};

}  // namespace mop
