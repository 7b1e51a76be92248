// ExpertDispatcher (see expert_dispatch.h).
#include "parallel/expert_dispatch.h"

namespace mop {

namespace {
MemKind host_kind(Ops& ops) { return ops.device() == Device::CUDA ? MemKind::Pinned : MemKind::Host; }
MemKind dev_kind(Ops& ops) { return ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host; }
}  // namespace

ExpertDispatcher::ExpertDispatcher(Comm& data, Comm& host, Ops& ops, int64_t num_experts,
                                   int64_t max_rows_in)
    : data_(data),
      host_(host),
      ops_(ops),
      size_(host.size()),
      rank_(host.rank()),
      experts_(num_experts),
      local_experts_(num_experts / host.size()),
      max_rows_in_(max_rows_in) {
  MOP_CHECK(num_experts % size_ == 0, "experts ", num_experts, " over ", size_, " ranks");
  send_rows_.assign(size_, 0);
  recv_rows_.assign(size_, 0);
  recv_counts_.assign(size_t(size_ * local_experts_), 0);
  host_buf_ = Buffer(host_kind(ops), size_t(local_experts_ + 1 + 2 * max_rows_in) * sizeof(int32_t));
  local_offsets_ = Tensor(host_buf_.data(), DType::I32, {local_experts_ + 1});
  index_dev_ = Buffer(dev_kind(ops), size_t(2 * max_rows_in) * sizeof(int32_t));
}

void ExpertDispatcher::plan(const int32_t* counts) {
  // Rows to each owner: its experts are a contiguous range of `counts`.
  rows_out_ = 0;
  for (int r = 0; r < size_; ++r) {
    send_rows_[r] = 0;
    for (int64_t e = 0; e < local_experts_; ++e) send_rows_[r] += counts[r * local_experts_ + e];
    rows_out_ += send_rows_[r];
  }
  // recv_counts_[s][e]: rows of my local expert e that source s sends.
  std::vector<int64_t> one(size_, local_experts_);
  host_.all_to_all_v(Tensor(recv_counts_.data(), DType::I32, {size_ * local_experts_, 1}), one,
                     Tensor(const_cast<int32_t*>(counts), DType::I32, {experts_, 1}), one);
  rows_in_ = 0;
  for (int s = 0; s < size_; ++s) {
    recv_rows_[s] = 0;
    for (int64_t e = 0; e < local_experts_; ++e) recv_rows_[s] += recv_counts_[s * local_experts_ + e];
    rows_in_ += recv_rows_[s];
  }
  MOP_CHECK(rows_in_ <= max_rows_in_, "expert dispatch: ", rows_in_, " rows exceed the planned ",
            max_rows_in_);
  // Received rows are source-major: source s's rows for my experts, each expert's rows together.
  // to_expert_major[r] (expert-major row r) = its source-major row.
  int32_t* offs = local_offsets_.ptr<int32_t>();
  int32_t* to_expert = offs + local_experts_ + 1;
  int32_t* to_source = to_expert + max_rows_in_;
  std::vector<int64_t> src_base(size_ + 1, 0);  // first source-major row of source s
  for (int s = 0; s < size_; ++s) src_base[s + 1] = src_base[s] + recv_rows_[s];
  std::vector<int64_t> within(size_, 0);  // first row of expert e inside source s's block
  offs[0] = 0;
  int64_t r = 0;
  for (int64_t e = 0; e < local_experts_; ++e) {
    for (int s = 0; s < size_; ++s) {
      int64_t n = recv_counts_[s * local_experts_ + e];
      for (int64_t j = 0; j < n; ++j, ++r) {
        int64_t src_row = src_base[s] + within[s] + j;
        to_expert[r] = int32_t(src_row);
        to_source[src_row] = int32_t(r);
      }
      within[s] += n;
    }
    offs[e + 1] = int32_t(r);
  }
  Device dev = ops_.device();
  Tensor dst(index_dev_.data(), DType::I32, {2 * max_rows_in_}, dev);
  ops_.copy(dst.rows(0, rows_in_), Tensor(to_expert, DType::I32, {rows_in_}));
  ops_.copy(dst.rows(max_rows_in_, max_rows_in_ + rows_in_), Tensor(to_source, DType::I32, {rows_in_}));
}

void ExpertDispatcher::dispatch(Tensor out, const Tensor& in, Tensor scratch) {
  MOP_CHECK(out.shape[0] == rows_in_ && in.shape[0] == rows_out_ && scratch.shape[0] >= rows_in_,
            "dispatch: rows ", out.shape[0], "/", in.shape[0], " vs planned ", rows_in_, "/", rows_out_);
  Tensor recv = scratch.rows(0, rows_in_);
  data_.all_to_all_v(recv, recv_rows_, in, send_rows_);
  Tensor idx(index_dev_.data(), DType::I32, {rows_in_}, ops_.device());
  ops_.moe_permute_fwd(out, recv, idx);
}

void ExpertDispatcher::combine(Tensor out, const Tensor& in, Tensor scratch) {
  MOP_CHECK(in.shape[0] == rows_in_ && out.shape[0] == rows_out_ && scratch.shape[0] >= rows_in_,
            "combine: rows ", in.shape[0], "/", out.shape[0], " vs planned ", rows_in_, "/", rows_out_);
  Tensor send = scratch.rows(0, rows_in_);
  Tensor idx(static_cast<int32_t*>(index_dev_.data()) + max_rows_in_, DType::I32, {rows_in_},
             ops_.device());
  ops_.moe_permute_fwd(send, in, idx);
  data_.all_to_all_v(out, send_rows_, send, recv_rows_);
}

}  // namespace mop
