// Ulysses exchange and the cp slicing of a batch (see sequence_parallel.h). Row units of the
// exchange: a local tensor [T_l, heads·D] is viewed as [T_l·cp, W] with W = heads/cp·D, so row
// t·cp + j is token t's j-th head slice.
#include "parallel/sequence_parallel.h"

namespace mop {

std::vector<int> zigzag_positions(int seq, int cp_size, int cp_rank) {
  MOP_CHECK(seq % (2 * cp_size) == 0, "sequence ", seq, " over ", 2 * cp_size, " chunks");
  const int c = seq / (2 * cp_size);
  std::vector<int> pos;
  for (int i = 0; i < c; ++i) pos.push_back(cp_rank * c + i);
  for (int i = 0; i < c; ++i) pos.push_back((2 * cp_size - 1 - cp_rank) * c + i);
  return pos;
}

SequenceSlicer::SequenceSlicer(int batch, int seq, int cp_size, int cp_rank)
    : batch_(batch), seq_(seq), local_seq_(seq / cp_size) {
  if (cp_size == 1) return;
  positions_ = zigzag_positions(seq, cp_size, cp_rank);
  const size_t full = size_t(batch) * size_t(seq);
  full_ids_.assign(full, 0), full_targets_.assign(full, 0), full_positions_.assign(full, 0);
}

int64_t SequenceSlicer::fill(const ReadWhole& read, int32_t* ids, int32_t* targets,
                             int32_t* positions) {
  if (positions_.empty()) return read(ids, targets, positions);
  read(full_ids_.data(), full_targets_.data(), full_positions_.data());
  const int64_t S = seq_, sl = local_seq_;
  int64_t valid = 0;
  for (int64_t q = 0; q < batch_; ++q)
    for (int64_t l = 0; l < sl; ++l) {
      const int64_t from = q * S + positions_[size_t(l)], to = q * sl + l;
      ids[to] = full_ids_[size_t(from)];
      targets[to] = full_targets_[size_t(from)];
      positions[to] = full_positions_[size_t(from)];
      valid += targets[to] >= 0;
    }
  return valid;
}

size_t UlyssesExchange::buffer_bytes(int batch, int seq, int64_t max_width, DType dtype) {
  const size_t n = size_t(batch) * size_t(seq);
  return 4 * n * sizeof(int32_t) + 2 * n * size_t(max_width) * dtype_size(dtype);
}

UlyssesExchange::UlyssesExchange(Comm& cp, Ops& ops, int batch, int seq, int64_t max_width, DType dtype)
    : comm_(cp),
      ops_(ops),
      cp_(cp.size()),
      batch_(batch),
      seq_(seq),
      local_tokens_(int64_t(batch) * seq / cp.size()),
      dtype_(dtype),
      max_width_(max_width) {
  const int64_t n = int64_t(batch) * seq, tl = local_tokens_, sl = seq / cp_;
  std::vector<int32_t> maps(size_t(4 * n));
  int32_t* pack = maps.data();  // send row j·T_l + t ← local row t·cp + j
  int32_t* unpack = pack + n;   // full row b·S + s ← recv row (owner of s)·T_l + its local row
  int32_t* pack_out = unpack + n;
  int32_t* unpack_out = pack_out + n;
  for (int j = 0; j < cp_; ++j)
    for (int64_t t = 0; t < tl; ++t) {
      pack[j * tl + t] = int32_t(t * cp_ + j);
      unpack_out[t * cp_ + j] = int32_t(j * tl + t);
    }
  for (int r = 0; r < cp_; ++r) {
    std::vector<int> pos = zigzag_positions(seq, cp_, r);
    for (int b = 0; b < batch; ++b)
      for (int64_t l = 0; l < sl; ++l) {
        int64_t full = int64_t(b) * seq + pos[size_t(l)], recv = r * tl + b * sl + l;
        unpack[full] = int32_t(recv);
        pack_out[recv] = int32_t(full);
      }
  }
  MemKind dev = ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host;
  index_ = Buffer(dev, maps.size() * sizeof(int32_t));
  ops.copy(Tensor(index_.data(), DType::I32, {4 * n}, ops.device()),
           Tensor(maps.data(), DType::I32, {4 * n}));
  send_ = Buffer(dev, size_t(n * max_width) * dtype_size(dtype));
  recv_ = Buffer(dev, size_t(n * max_width) * dtype_size(dtype));
}

Tensor UlyssesExchange::map(int which) const {
  const int64_t n = int64_t(batch_) * seq_;
  return Tensor(static_cast<int32_t*>(index_.data()) + which * n, DType::I32, {n}, ops_.device());
}

Tensor UlyssesExchange::scratch(const Buffer& b, int64_t width) const {
  MOP_CHECK(width <= max_width_, "exchange width ", width, " over the planned ", max_width_);
  return Tensor(b.data(), dtype_, {int64_t(batch_) * seq_, width}, ops_.device());
}

void UlyssesExchange::to_full(Tensor full, const Tensor& local, int64_t heads) {
  const int64_t width = local.numel() / (local_tokens_ * cp_);
  MOP_CHECK(heads % cp_ == 0 && local.shape[0] == local_tokens_, "to_full: ", local.shape_str());
  Tensor rows = local.view({local_tokens_ * cp_, width});
  Tensor send = scratch(send_, width), recv = scratch(recv_, width);
  ops_.moe_permute_fwd(send, rows, map(0));
  std::vector<int64_t> counts(size_t(cp_), local_tokens_);
  comm_.all_to_all_v(recv, counts, send, counts);
  ops_.moe_permute_fwd(full.view({int64_t(batch_) * seq_, width}), recv, map(1));
}

void UlyssesExchange::to_local(Tensor local, const Tensor& full, int64_t heads) {
  const int64_t width = local.numel() / (local_tokens_ * cp_);
  MOP_CHECK(heads % cp_ == 0 && local.shape[0] == local_tokens_, "to_local: ", local.shape_str());
  Tensor send = scratch(send_, width), recv = scratch(recv_, width);
  ops_.moe_permute_fwd(send, full.view({int64_t(batch_) * seq_, width}), map(2));
  std::vector<int64_t> counts(size_t(cp_), local_tokens_);
  comm_.all_to_all_v(recv, counts, send, counts);
  ops_.moe_permute_fwd(local.view({local_tokens_ * cp_, width}), recv, map(3));
}

}  // namespace mop
