// ExpertDispatcher (see expert_dispatch.h).
#include "parallel/expert_dispatch.h"

#include <algorithm>

namespace mop {

namespace {
MemKind host_kind(Ops& ops) { return ops.device() == Device::CUDA ? MemKind::Pinned : MemKind::Host; }
MemKind dev_kind(Ops& ops) { return ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host; }
}  // namespace

ExpertDispatcher::ExpertDispatcher(Comm& data, Comm& host, Ops& ops, int64_t num_experts,
                                   int64_t max_rows_in, int chunks, Comm* dispatch, Comm* combine)
    : data_(data),
      host_(host),
      dispatch_(dispatch),
      combine_(combine),
      ops_(ops),
      size_(host.size()),
      rank_(host.rank()),
      experts_(num_experts),
      local_experts_(num_experts / host.size()),
      max_rows_in_(max_rows_in) {
  MOP_CHECK(num_experts % size_ == 0, "experts ", num_experts, " over ", size_, " ranks");
  MOP_CHECK(chunks >= 1, "expert chunks: ", chunks);
  chunks_ = int(std::min<int64_t>(chunks, std::max<int64_t>(local_experts_, 1)));
  for (int c = 0; c <= chunks_; ++c) chunk_e0_.push_back(c * local_experts_ / chunks_);
  global_offsets_.assign(size_t(experts_ + 1), 0);
  recv_counts_.assign(size_t(size_ * local_experts_), 0);
  const Footprint f = footprint(num_experts, size_, max_rows_in, chunks);
  host_buf_ = Buffer(host_kind(ops), f.host_bytes);
  local_offsets_ = Tensor(host_buf_.data(), DType::I32, {local_experts_ + 1});
  chunk_offsets_ = local_offsets_.ptr<int32_t>() + local_experts_ + 1;
  index_dev_ = Buffer(dev_kind(ops), f.device_bytes);
}

ExpertDispatcher::Footprint ExpertDispatcher::footprint(int64_t num_experts, int ep_size,
                                                        int64_t max_rows_in, int chunks) {
  const int64_t local = num_experts / ep_size;
  const int64_t used_chunks = std::min<int64_t>(chunks, std::max<int64_t>(local, 1));
  return {size_t(2 * max_rows_in) * sizeof(int32_t),
          size_t(2 * local + used_chunks + 1 + 2 * max_rows_in) * sizeof(int32_t)};
}

void ExpertDispatcher::plan(const int32_t* counts) {
  for (int64_t e = 0; e < experts_; ++e) global_offsets_[size_t(e + 1)] = global_offsets_[size_t(e)] + counts[e];
  rows_out_ = global_offsets_[size_t(experts_)];
  // recv_counts_[s][e]: rows of my local expert e that source s sends.
  std::vector<int64_t> one(size_, local_experts_);
  host_.all_to_all_v(Tensor(recv_counts_.data(), DType::I32, {size_ * local_experts_, 1}), one,
                     Tensor(const_cast<int32_t*>(counts), DType::I32, {experts_, 1}), one);
  int32_t* offs = local_offsets_.ptr<int32_t>();
  offs[0] = 0;
  for (int64_t e = 0; e < local_experts_; ++e) {
    int64_t n = 0;
    for (int s = 0; s < size_; ++s) n += recv_counts_[size_t(s * local_experts_ + e)];
    offs[e + 1] = int32_t(offs[e] + n);
  }
  rows_in_ = offs[local_experts_];
  MOP_CHECK(rows_in_ <= max_rows_in_, "expert dispatch: ", rows_in_, " rows exceed the planned ",
            max_rows_in_);
  // Per chunk: its offsets from 0, and the two index maps between the order rows arrive in
  // (source-major within the chunk) and the experts' order (expert-major), relative to the chunk.
  int32_t* to_expert = chunk_offsets_ + local_experts_ + chunks_;
  int32_t* to_source = to_expert + max_rows_in_;
  for (int c = 0; c < chunks_; ++c) {
    const int64_t e0 = chunk_e0_[size_t(c)], e1 = chunk_e0_[size_t(c + 1)], base = offs[e0];
    for (int64_t e = e0; e <= e1; ++e) chunk_offsets_[e + c] = int32_t(offs[e] - base);
    int64_t src_row = 0;  // source-major row within the chunk
    for (int s = 0; s < size_; ++s)
      for (int64_t e = e0; e < e1; ++e) {
        int64_t first = offs[e] - base;  // expert e's first row in the chunk, expert-major
        for (int s2 = 0; s2 < s; ++s2) first += recv_counts_[size_t(s2 * local_experts_ + e)];
        for (int64_t j = 0; j < recv_counts_[size_t(s * local_experts_ + e)]; ++j, ++src_row) {
          to_expert[base + first + j] = int32_t(src_row);
          to_source[base + src_row] = int32_t(first + j);
        }
      }
  }
  Device dev = ops_.device();
  Tensor dst(index_dev_.data(), DType::I32, {2 * max_rows_in_}, dev);
  ops_.copy(dst.rows(0, rows_in_), Tensor(to_expert, DType::I32, {rows_in_}));
  ops_.copy(dst.rows(max_rows_in_, max_rows_in_ + rows_in_), Tensor(to_source, DType::I32, {rows_in_}));
}

ExpertDispatcher::Chunk ExpertDispatcher::chunk(int c) const {
  MOP_CHECK(c >= 0 && c < chunks_, "expert chunk ", c, " of ", chunks_);
  Chunk k;
  k.e0 = chunk_e0_[size_t(c)], k.e1 = chunk_e0_[size_t(c + 1)];
  const int32_t* offs = local_offsets_.ptr<int32_t>();
  k.row0 = offs[k.e0], k.rows = offs[k.e1] - offs[k.e0];
  k.offsets = Tensor(chunk_offsets_ + k.e0 + c, DType::I32, {k.e1 - k.e0 + 1});
  return k;
}

ExpertDispatcher::Spans ExpertDispatcher::spans(int c) const {
  const int64_t e0 = chunk_e0_[size_t(c)], e1 = chunk_e0_[size_t(c + 1)];
  Spans sp;
  sp.to_peer.assign(size_t(size_), 0), sp.from_peer.assign(size_t(size_), 0);
  sp.global_at.assign(size_t(size_), 0), sp.scratch_at.assign(size_t(size_), 0);
  int64_t at = local_offsets_.ptr<int32_t>()[e0];
  for (int r = 0; r < size_; ++r) {
    const int64_t g0 = r * local_experts_ + e0, g1 = r * local_experts_ + e1;
    sp.to_peer[size_t(r)] = global_offsets_[size_t(g1)] - global_offsets_[size_t(g0)];
    sp.global_at[size_t(r)] = global_offsets_[size_t(g0)];
    for (int64_t e = e0; e < e1; ++e) sp.from_peer[size_t(r)] += recv_counts_[size_t(r * local_experts_ + e)];
    sp.scratch_at[size_t(r)] = at;
    at += sp.from_peer[size_t(r)];
  }
  return sp;
}

void ExpertDispatcher::run(const Tensor& in, Tensor out, Tensor x_local, Tensor y_local,
                           Tensor scratch, const std::function<void(const Chunk&)>& experts) {
  MOP_CHECK(in.shape[0] == rows_out_ && out.shape[0] == rows_out_ && x_local.shape[0] == rows_in_ &&
                y_local.shape[0] == rows_in_ && scratch.shape[0] >= rows_in_,
            "expert dispatch: rows ", in.shape[0], "/", out.shape[0], "/", x_local.shape[0], "/",
            y_local.shape[0], "/", scratch.shape[0], " vs planned ", rows_out_, "/", rows_in_);
  Comm& to_experts = dispatch_ ? *dispatch_ : data_;
  Comm& back = combine_ ? *combine_ : data_;
  const Device dev = ops_.device();
  auto* index = static_cast<int32_t*>(index_dev_.data());
  std::vector<Spans> sp(static_cast<size_t>(chunks_));
  auto dispatch = [&](int c) {
    sp[size_t(c)] = spans(c);
    const Spans& s = sp[size_t(c)];
    to_experts.all_to_all_v(scratch, s.from_peer, s.scratch_at, in, s.to_peer, s.global_at);
  };
  dispatch(0);
  for (int c = 0; c < chunks_; ++c) {
    // Chunk c's rows have arrived (its dispatch is the only one in flight); the next chunk's
    // travel while this one computes, and this one's results return during the next.
    to_experts.join();
    if (c + 1 < chunks_) dispatch(c + 1);
    const Chunk k = chunk(c);
    if (k.rows) {
      const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
      ops_.moe_permute_fwd(x_local.rows(r0, r1), scratch.rows(r0, r1),
                           Tensor(index + r0, DType::I32, {k.rows}, dev));
      experts(k);
      ops_.moe_permute_fwd(scratch.rows(r0, r1), y_local.rows(r0, r1),
                           Tensor(index + max_rows_in_ + r0, DType::I32, {k.rows}, dev));
    }
    // Every rank takes part in every chunk's exchanges, also with no rows of its own in it.
    const Spans& s = sp[size_t(c)];
    back.all_to_all_v(out, s.to_peer, s.global_at, scratch, s.from_peer, s.scratch_at);
  }
  back.join();
}

}  // namespace mop
