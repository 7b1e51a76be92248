// ExpertDispatcher: moves expert-ordered token rows between the ranks of an expert-parallel group
// (dropless: every row reaches its expert's owner). Each rank owns experts
// [ep_rank·E_local, (ep_rank+1)·E_local). Per MoE layer and micro-batch:
//   plan(counts)        rows per global expert on this rank → an all-to-all of counts tells every
//                       owner how many rows of each of its experts come from each source rank
//   dispatch(out, in)   in: this rank's rows in expert order over all E (the permuted tokens);
//                       out: the rows of this rank's experts from every source, expert-major
//                       (then source, then the source's order) — ready for the grouped GEMM
//   combine(out, in)    the exact inverse (and the backward of dispatch): results back to their
//                       source ranks, in the source's expert order
// Layout of the exchange: a variable all-to-all of rows (source-major), then a row gather into
// expert-major order (and the reverse for combine), both on the ops device.
#pragma once

#include <vector>

#include "core/memory.h"
#include "ops/ops.h"
#include "parallel/comm.h"

namespace mop {

class ExpertDispatcher {
 public:
  // data: tensor comm of the ep group on the ops device; host: the same group for counts.
  // max_rows_in: the most rows this rank can receive (ep_size × its own maximum: dropless).
  ExpertDispatcher(Comm& data, Comm& host, Ops& ops, int64_t num_experts, int64_t max_rows_in);

  void plan(const int32_t* counts);  // host I32 [num_experts]: this rank's rows per expert
  int64_t rows_out() const { return rows_out_; }  // rows this rank sends (Σ counts)
  int64_t rows_in() const { return rows_in_; }    // rows it receives for its experts
  const Tensor& local_offsets() const { return local_offsets_; }  // host I32 [E_local + 1]

  // out [rows_in, W] ← in [rows_out, W]; scratch: [max_rows_in, W] of the same dtype.
  void dispatch(Tensor out, const Tensor& in, Tensor scratch);
  // out [rows_out, W] ← in [rows_in, W]; scratch as for dispatch.
  void combine(Tensor out, const Tensor& in, Tensor scratch);

 private:
  Comm& data_;
  Comm& host_;
  Ops& ops_;
  int size_, rank_;
  int64_t experts_, local_experts_, max_rows_in_;
  int64_t rows_out_ = 0, rows_in_ = 0;
  std::vector<int64_t> send_rows_, recv_rows_;  // per peer
  std::vector<int32_t> recv_counts_;            // [source][local expert]
  Buffer host_buf_;      // host: local offsets, the two index maps before upload
  Tensor local_offsets_;
  Buffer index_dev_;     // device I32: to_expert_major [max_rows_in], to_source_major [max_rows_in]
};

}  // namespace mop
