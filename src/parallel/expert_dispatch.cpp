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
  MOP_CHECK(max_rows_in >= 1, "expert dispatch: receive buffers of ", max_rows_in, " rows");
  chunks_ = int(std::min<int64_t>(chunks, std::max<int64_t>(local_experts_, 1)));
  for (int c = 0; c <= chunks_; ++c) chunk_e0_.push_back(c * local_experts_ / chunks_);
  global_offsets_.assign(size_t(experts_ + 1), 0);
  all_counts_.assign(size_t(size_ * experts_), 0);
  layout_offsets_.assign(size_t(size_ * (local_experts_ + 1)), 0);
  starts_.assign(size_t(size_ * local_experts_ * size_), 0);
  const Footprint f = footprint(num_experts, size_, max_rows_in, chunks);
  host_buf_ = Buffer(host_kind(ops), f.host_bytes);
  index_dev_ = Buffer(dev_kind(ops), f.device_bytes);
}

ExpertDispatcher::Footprint ExpertDispatcher::footprint(int64_t, int, int64_t max_rows_in, int) {
  const size_t maps = size_t(2 * max_rows_in) * sizeof(int32_t);
  return {maps, maps};
}

void ExpertDispatcher::plan(const int32_t* counts, int moe_layer) {
  for (int64_t e = 0; e < experts_; ++e) global_offsets_[size_t(e + 1)] = global_offsets_[size_t(e)] + counts[e];
  rows_out_ = global_offsets_[size_t(experts_)];
  // Every rank's counts: each rank lays out every receiver's rows and rounds the same way.
  host_.all_gather_expert_counts(Tensor(all_counts_.data(), DType::I32, {size_ * experts_}),
                                 Tensor(const_cast<int32_t*>(counts), DType::I32, {experts_}), moe_layer);
  const int64_t El = local_experts_;
  int64_t most_in = 0;
  for (int q = 0; q < size_; ++q) {
    int64_t* offs = &layout_offsets_[size_t(q * (El + 1))];
    offs[0] = 0;
    for (int64_t e = 0; e < El; ++e) {
      int64_t at = offs[e];
      for (int s = 0; s < size_; ++s) {
        starts_[size_t((q * El + e) * size_ + s)] = at;
        at += all_counts_[size_t(s * experts_ + q * El + e)];
      }
      offs[e + 1] = at;
    }
    most_in = std::max(most_in, offs[El]);
  }
  rows_in_ = layout_offsets_[size_t(rank_ * (El + 1) + El)];
  rounds_ = int(std::max<int64_t>(1, (most_in + max_rows_in_ - 1) / max_rows_in_));
  // This rank's chunks: the expert chunks with one round, else the rounds. Offsets per chunk
  // from 0, clamped to its rows (a round may start or end inside an expert's rows).
  const int pieces = rounds_ > 1 ? rounds_ : chunks_;
  const int64_t* offs = &layout_offsets_[size_t(rank_ * (El + 1))];
  piece_e0_.assign(size_t(pieces), 0), piece_e1_.assign(size_t(pieces), 0);
  piece_row0_.assign(size_t(pieces), 0), piece_rows_.assign(size_t(pieces), 0);
  offsets_at_.assign(size_t(pieces), 0);
  piece_offsets_.clear();
  for (int c = 0; c < pieces; ++c) {
    const int64_t a = begin(rank_, c), b = begin(rank_, c + 1);
    int64_t e0 = 0, e1 = 0;
    if (rounds_ == 1) {
      e0 = chunk_e0_[size_t(c)], e1 = chunk_e0_[size_t(c + 1)];
    } else if (b > a) {
      e0 = int64_t(std::upper_bound(offs, offs + El + 1, a) - offs) - 1;  // offs[e0] ≤ a < offs[e0+1]
      e1 = int64_t(std::lower_bound(offs, offs + El + 1, b) - offs);      // offs[e1-1] < b ≤ offs[e1]
    }
    piece_e0_[size_t(c)] = e0, piece_e1_[size_t(c)] = e1;
    piece_row0_[size_t(c)] = rounds_ > 1 ? 0 : a, piece_rows_[size_t(c)] = b - a;
    offsets_at_[size_t(c)] = piece_offsets_.size();
    for (int64_t e = e0; e <= e1; ++e)
      piece_offsets_.push_back(int32_t(std::clamp<int64_t>(offs[e] - a, 0, b - a)));
  }
  // One round: every chunk's maps now, in one upload (rows_in ≤ max_rows_in); rounds upload
  // theirs in run.
  if (rounds_ == 1) {
    auto* host = static_cast<int32_t*>(host_buf_.data());
    for (int c = 0; c < pieces; ++c) {
      const int64_t row0 = piece_row0_[size_t(c)];
      chunk_maps(c, host + row0, host + max_rows_in_ + row0);
    }
    upload_maps(0, rows_in_);
  }
}

int64_t ExpertDispatcher::begin(int q, int c) const {
  const int64_t* offs = &layout_offsets_[size_t(q * (local_experts_ + 1))];
  if (rounds_ == 1) return offs[chunk_e0_[size_t(c)]];
  return std::min(int64_t(c) * max_rows_in_, offs[local_experts_]);
}

int64_t ExpertDispatcher::before(int q, int s, int64_t row) const {
  int64_t n = 0;
  for (int64_t e = 0; e < local_experts_; ++e) {
    const int64_t start = starts_[size_t((q * local_experts_ + e) * size_ + s)];
    const int64_t count = all_counts_[size_t(s * experts_ + q * local_experts_ + e)];
    n += std::clamp<int64_t>(row - start, 0, count);
  }
  return n;
}

void ExpertDispatcher::chunk_maps(int c, int32_t* to_expert, int32_t* to_source) const {
  const int64_t a = begin(rank_, c), b = begin(rank_, c + 1);
  int64_t src_row = 0;  // source-major row within the chunk
  for (int s = 0; s < size_; ++s)
    for (int64_t e = 0; e < local_experts_; ++e) {
      const int64_t start = starts_[size_t((rank_ * local_experts_ + e) * size_ + s)];
      const int64_t count = all_counts_[size_t(s * experts_ + rank_ * local_experts_ + e)];
      for (int64_t row = std::max(start, a); row < std::min(start + count, b); ++row, ++src_row) {
        to_expert[row - a] = int32_t(src_row);
        to_source[src_row] = int32_t(row - a);
      }
    }
}

void ExpertDispatcher::upload_maps(int64_t row0, int64_t rows) {
  if (!rows) return;
  auto* host = static_cast<int32_t*>(host_buf_.data());
  // The copies return once the staging may be reused (ops.h): the next round refills it.
  Tensor dst(index_dev_.data(), DType::I32, {2 * max_rows_in_}, ops_.device());
  ops_.copy(dst.rows(row0, row0 + rows), Tensor(host + row0, DType::I32, {rows}));
  ops_.copy(dst.rows(max_rows_in_ + row0, max_rows_in_ + row0 + rows),
            Tensor(host + max_rows_in_ + row0, DType::I32, {rows}));
}

ExpertDispatcher::Chunk ExpertDispatcher::chunk(int c) const {
  MOP_CHECK(c >= 0 && c < num_chunks(), "expert chunk ", c, " of ", num_chunks());
  Chunk k;
  k.e0 = piece_e0_[size_t(c)], k.e1 = piece_e1_[size_t(c)];
  k.row0 = piece_row0_[size_t(c)], k.rows = piece_rows_[size_t(c)];
  k.offsets = Tensor(const_cast<int32_t*>(piece_offsets_.data() + offsets_at_[size_t(c)]), DType::I32,
                     {k.e1 - k.e0 + 1});
  return k;
}

ExpertDispatcher::Spans ExpertDispatcher::spans(int c) const {
  Spans sp;
  sp.to_peer.assign(size_t(size_), 0), sp.from_peer.assign(size_t(size_), 0);
  sp.global_at.assign(size_t(size_), 0), sp.scratch_at.assign(size_t(size_), 0);
  // My rows for peer q's experts: q's chunk c covers the ones between these two of q's rows.
  for (int q = 0; q < size_; ++q) {
    const int64_t lo = before(q, rank_, begin(q, c)), hi = before(q, rank_, begin(q, c + 1));
    sp.to_peer[size_t(q)] = hi - lo;
    sp.global_at[size_t(q)] = global_offsets_[size_t(q * local_experts_)] + lo;
  }
  const int64_t a = begin(rank_, c), b = begin(rank_, c + 1);
  int64_t at = piece_row0_[size_t(c)];
  for (int s = 0; s < size_; ++s) {
    sp.from_peer[size_t(s)] = before(rank_, s, b) - before(rank_, s, a);
    sp.scratch_at[size_t(s)] = at;
    at += sp.from_peer[size_t(s)];
  }
  return sp;
}

void ExpertDispatcher::run(const Tensor& in, Tensor out, Tensor x_local, Tensor y_local,
                           Tensor scratch, const std::function<void(const Chunk&)>& experts,
                           const Tensor* with, Tensor with_local) {
  const int64_t held = rows_held();
  MOP_CHECK(in.shape[0] == rows_out_ && out.shape[0] == rows_out_ && x_local.shape[0] >= held &&
                y_local.shape[0] >= held && scratch.shape[0] >= held,
            "expert dispatch: rows ", in.shape[0], "/", out.shape[0], "/", x_local.shape[0], "/",
            y_local.shape[0], "/", scratch.shape[0], " vs planned ", rows_out_, "/", held);
  MOP_CHECK(!with || (with->shape[0] == rows_out_ && with_local.shape[0] >= held &&
                      with->dtype == scratch.dtype && with->shape[1] == scratch.shape[1]),
            "expert dispatch: rows travelling alongside do not match");
  Comm& to_experts = dispatch_ ? *dispatch_ : data_;
  Comm& back = combine_ ? *combine_ : data_;
  const Device dev = ops_.device();
  auto* index = static_cast<int32_t*>(index_dev_.data());
  auto arrived = [&](Tensor dst, const Chunk& k) {  // scratch's rows of the chunk, expert-major
    const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
    ops_.moe_permute_fwd(dst.rows(r0, r1), scratch.rows(r0, r1),
                         Tensor(index + r0, DType::I32, {k.rows}, dev));
  };
  auto compute = [&](const Chunk& k) {
    if (!k.rows) return;
    arrived(x_local, k);
    experts(k);
    const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
    ops_.moe_permute_fwd(scratch.rows(r0, r1), y_local.rows(r0, r1),
                         Tensor(index + max_rows_in_ + r0, DType::I32, {k.rows}, dev));
  };
  if (rounds_ == 1 && !with) {
    std::vector<Spans> sp(static_cast<size_t>(num_chunks()));
    auto dispatch = [&](int c) {
      sp[size_t(c)] = spans(c);
      const Spans& s = sp[size_t(c)];
      to_experts.all_to_all_v(scratch, s.from_peer, s.scratch_at, in, s.to_peer, s.global_at);
    };
    dispatch(0);
    for (int c = 0; c < num_chunks(); ++c) {
      // Chunk c's rows have arrived (its dispatch is the only one in flight); the next chunk's
      // travel while this one computes, and this one's results return during the next.
      to_experts.join();
      if (c + 1 < num_chunks()) dispatch(c + 1);
      compute(chunk(c));
      // Every rank takes part in every chunk's exchanges, also with no rows of its own in it.
      const Spans& s = sp[size_t(c)];
      back.all_to_all_v(out, s.to_peer, s.global_at, scratch, s.from_peer, s.scratch_at);
    }
    back.join();
    return;
  }
  // Rounds (or rows travelling alongside): one chunk at a time through the one scratch. Each
  // collective waits for the compute issued before it and each is joined before the compute that
  // reads its rows, so scratch is never written and read at once.
  for (int c = 0; c < num_chunks(); ++c) {
    const Chunk k = chunk(c);
    if (rounds_ > 1 && k.rows) {
      auto* host = static_cast<int32_t*>(host_buf_.data());
      chunk_maps(c, host, host + max_rows_in_);
      upload_maps(0, k.rows);
    }
    const Spans s = spans(c);
    if (with) {
      to_experts.all_to_all_v(scratch, s.from_peer, s.scratch_at, *with, s.to_peer, s.global_at);
      to_experts.join();
      if (k.rows) arrived(with_local, k);
    }
    to_experts.all_to_all_v(scratch, s.from_peer, s.scratch_at, in, s.to_peer, s.global_at);
    to_experts.join();
    compute(k);
    back.all_to_all_v(out, s.to_peer, s.global_at, scratch, s.from_peer, s.scratch_at);
    back.join();
  }
}

}  // namespace mop
