// Causal attention over query tiles (see tiled_attention.h). Buffer layout (one allocation on the
// ops device, each part aligned to kAlign bytes), with c = tile, S = max_seq, Q = Nq·D, KV = Nkv·D:
//   acc              [c, Q] acc        forward: the tile's output accumulator; backward: its dq sum
//   part_q           [c, Q] compute    a block's output (forward) or dq (backward)
//   part_lse         [Nq, c] acc       a block's lse
//   part_dk, part_dv [c, KV] compute   a block's dk, dv
//   sum_dk, sum_dv   [S, KV] acc       one sequence's dk, dv sums (none when lent by the caller)
//   conv             [c, Q] acc        a block's gradient converted to acc (compute ≠ acc runs)
#include "model/tiled_attention.h"

#include <limits>

#include "core/error.h"

namespace mop {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  size_t acc, part_q, part_lse, part_dk, part_dv, sum_dk, sum_dv, conv, total;
};

Layout plan_layout(int64_t tile, int64_t max_seq, int64_t nq, int64_t nkv, int64_t dim, DType cdt,
                   bool lend_sums) {
  const size_t cs = dtype_size(cdt), as = dtype_size(acc_dtype(cdt));
  const size_t c = size_t(tile), S = size_t(max_seq), q = size_t(nq * dim), kv = size_t(nkv * dim);
  Layout l{};
  size_t off = 0;
  l.acc = off, off += align_up(c * q * as);
  l.part_q = off, off += align_up(c * q * cs);
  l.part_lse = off, off += align_up(size_t(nq) * c * as);
  l.part_dk = off, off += align_up(c * kv * cs);
  l.part_dv = off, off += align_up(c * kv * cs);
  const size_t sums = lend_sums ? 0 : align_up(S * kv * as);
  l.sum_dk = off, off += sums;
  l.sum_dv = off, off += sums;
  l.conv = off, off += cs == as ? 0 : align_up(c * q * as);
  l.total = off;
  return l;
}

}  // namespace

size_t TiledAttention::buffer_bytes(int64_t tile, int64_t max_seq, int64_t num_q_heads,
                                    int64_t num_kv_heads, int64_t head_dim, DType dtype,
                                    bool lend_sums) {
  if (!tiled(tile, max_seq)) return 0;
  return plan_layout(tile, max_seq, num_q_heads, num_kv_heads, head_dim, dtype, lend_sums).total;
}

bool TiledAttention::sums_fit(size_t bytes, int64_t max_seq, int64_t num_kv_heads,
                              int64_t head_dim, DType dtype) {
  return bytes >= 2 * size_t(max_seq * num_kv_heads * head_dim) * dtype_size(acc_dtype(dtype));
}

int64_t TiledAttention::calls_per_sequence(int64_t tile, int64_t seq) {
  if (!tiled(tile, seq)) return 1;
  const int64_t n = seq / tile;
  return n * (n + 1) / 2;
}

TiledAttention::TiledAttention(Ops& ops, int64_t tile, int64_t max_seq, int64_t num_q_heads,
                               int64_t num_kv_heads, int64_t head_dim, DType dtype, bool lend_sums)
    : ops_(ops),
      tile_(tiled(tile, max_seq) ? tile : 0),
      max_seq_(max_seq),
      nq_(num_q_heads),
      nkv_(num_kv_heads),
      dim_(head_dim),
      lend_sums_(lend_sums),
      cdt_(dtype),
      adt_(acc_dtype(dtype)) {
  if (!tile_) return;
  MOP_USER_CHECK(max_seq % tile_ == 0, "train.attention_tile: ", tile_,
                 " tokens do not divide the ", max_seq, " tokens of a sequence's attention");
  // The GPU backend runs one-token attention through a path that takes the block's softmax to
  // be its own (cuDNN rejects S = 1), which a tile's off-diagonal block's is not.
  MOP_USER_CHECK(ops.device() == Device::CPU || tile_ >= 2,
                 "train.attention_tile: tiles of one token cannot run on the GPU; use at least 2");
  const Layout l = plan_layout(tile_, max_seq, nq_, nkv_, dim_, cdt_, lend_sums_);
  acc_ = l.acc, part_q_ = l.part_q, part_lse_ = l.part_lse, part_dk_ = l.part_dk;
  part_dv_ = l.part_dv, sum_dk_ = l.sum_dk, sum_dv_ = l.sum_dv, conv_ = l.conv;
  buffer_ = Buffer(ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host, l.total);
}

Tensor TiledAttention::at(size_t offset, DType dtype, std::initializer_list<int64_t> dims) const {
  return Tensor(static_cast<char*>(buffer_.data()) + offset, dtype, dims, ops_.device());
}

int64_t TiledAttention::check(const Tensor& q, const Tensor& k, const Tensor& lse, int batch,
                              const char* op) const {
  MOP_CHECK(batch > 0 && q.ndim == 3 && q.shape[0] % batch == 0, op, ": q ", q.shape_str(),
            " is not [batch·S, Nq, D] of ", batch, " sequences");
  const int64_t seq = q.shape[0] / batch;
  MOP_CHECK(seq <= max_seq_ && seq % tile_ == 0 && q.shape[1] == nq_ && q.shape[2] == dim_ &&
                k.ndim == 3 && k.shape[0] == q.shape[0] && k.shape[1] == nkv_ && k.shape[2] == dim_,
            op, ": q ", q.shape_str(), ", k ", k.shape_str(), " against tiles of ", tile_,
            " of at most ", max_seq_, " tokens, ", nq_, "/", nkv_, " heads of ", dim_);
  MOP_CHECK(q.dtype == cdt_ && k.dtype == cdt_, op, ": dtype ", dtype_name(q.dtype));
  MOP_CHECK(lse.dtype == adt_ && lse.numel() == q.shape[0] * nq_, op, ": lse ", lse.shape_str());
  return seq;
}

bool TiledAttention::runs_tiled(const Tensor& q, int batch) const {
  if (!tile_ || batch <= 0 || q.ndim != 3 || q.shape[0] % batch != 0) return false;
  const int64_t seq = q.shape[0] / batch;
  return tiled(tile_, seq) && seq % tile_ == 0;
}

Tensor TiledAttention::lse_tile(const Tensor& lse, int64_t seq, int64_t b, int64_t s0) const {
  const int64_t begin = (b * seq + s0) * nq_;
  return lse.view({lse.numel()}).rows(begin, begin + tile_ * nq_).view({1, nq_, tile_});
}

void TiledAttention::accumulate(Tensor acc, const Tensor& part) {
  const int64_t n = part.numel();
  Tensor flat = acc.view({n});
  if (part.dtype == acc.dtype) {
    ops_.add(flat, flat, part.view({n}));
    return;
  }
  Tensor conv = at(conv_, adt_, {n});
  ops_.copy(conv, part.view({n}));
  ops_.add(flat, flat, conv);
}

void TiledAttention::forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                             const Tensor& v, int batch, float scale, int64_t rows) {
  const int64_t T = q.ndim == 3 ? q.shape[0] : 0;
  if (rows >= 0 && rows != T) {
    MOP_CHECK(batch == 1 && runs_tiled(q, batch) && rows > 0 && rows < T && rows % tile_ == 0,
              "tiled attention forward: the first ", rows, " of ", T, " rows in ", batch,
              " sequence(s) are not whole tiles of ", tile_, " of one tiled sequence");
  }
  if (!runs_tiled(q, batch)) {
    ops_.attention_fwd(out, lse.view({batch, nq_, lse.numel() / (int64_t(batch) * nq_)}), q, k,
                       v, batch, scale, true);
    return;
  }
  const int64_t seq = check(q, k, lse, batch, "tiled attention forward"), c = tile_;
  Tensor acc = at(acc_, adt_, {c, nq_, dim_}), part_o = at(part_q_, cdt_, {c, nq_, dim_});
  Tensor part_lse = at(part_lse_, adt_, {1, nq_, c});
  const int64_t end = rows >= 0 && rows < T ? rows : seq;  // query rows of each sequence to compute
  for (int64_t b = 0; b < batch; ++b)
    for (int64_t i0 = 0; i0 < end; i0 += c) {
      const int64_t q0 = b * seq + i0;
      Tensor lse_i = lse_tile(lse, seq, b, i0);
      if (i0 == 0) {  // the first tile sees only itself: one causal call, nothing to merge
        ops_.attention_fwd(out.rows(q0, q0 + c), lse_i, q.rows(q0, q0 + c), k.rows(q0, q0 + c),
                           v.rows(q0, q0 + c), 1, scale, true);
        continue;
      }
      // lse = −inf: an empty accumulator (the first merge ignores acc).
      ops_.fill(lse_i, -std::numeric_limits<double>::infinity());
      for (int64_t j0 = 0; j0 <= i0; j0 += c) {
        const int64_t k0 = b * seq + j0;
        ops_.attention_fwd(part_o, part_lse, q.rows(q0, q0 + c), k.rows(k0, k0 + c),
                           v.rows(k0, k0 + c), 1, scale, j0 == i0);
        ops_.attention_merge(acc, lse_i, part_o, part_lse, 1);
      }
      ops_.copy(out.rows(q0, q0 + c), acc);
    }
}

void TiledAttention::backward_short(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout,
                                    const Tensor& q, const Tensor& k, const Tensor& v,
                                    const Tensor& out, const Tensor& lse, int batch, float scale) {
  const int64_t seq = batch > 0 && q.ndim == 3 ? q.shape[0] / batch : 0;
  MOP_CHECK(tile_ > 0 && seq > 0 && seq <= tile_, "tiled attention backward: dq shares dout, which "
            "needs sequences of at most one tile (", tile_, " tokens), not ", seq);
  // Each sequence's gradients in the tile's buffers, then copied out (its dout is read by then).
  Tensor part_dq = at(part_q_, cdt_, {tile_, nq_, dim_}).rows(0, seq);
  Tensor part_dk = at(part_dk_, cdt_, {tile_, nkv_, dim_}).rows(0, seq);
  Tensor part_dv = at(part_dv_, cdt_, {tile_, nkv_, dim_}).rows(0, seq);
  for (int64_t b = 0; b < batch; ++b) {
    const int64_t r0 = b * seq, r1 = r0 + seq;
    Tensor lse_b = lse.view({lse.numel()}).rows(r0 * nq_, r1 * nq_).view({1, nq_, seq});
    ops_.attention_bwd(part_dq, part_dk, part_dv, dout.rows(r0, r1), q.rows(r0, r1), k.rows(r0, r1),
                       v.rows(r0, r1), out.rows(r0, r1), lse_b, 1, scale, true);
    ops_.copy(dq.rows(r0, r1), part_dq);
    ops_.copy(dk.rows(r0, r1), part_dk);
    ops_.copy(dv.rows(r0, r1), part_dv);
  }
}

void TiledAttention::backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                              const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                              int batch, float scale, Tensor lent) {
  if (!runs_tiled(q, batch)) {
    if (!overlap(dq, dout)) {
      ops_.attention_bwd(dq, dk, dv, dout, q, k, v, out,
                         lse.view({batch, nq_, lse.numel() / (int64_t(batch) * nq_)}), batch,
                         scale, true);
      return;
    }
    backward_short(dq, dk, dv, dout, q, k, v, out, lse, batch, scale);
    return;
  }
  const int64_t seq = check(q, k, lse, batch, "tiled attention backward"), c = tile_;
  Tensor dq_sum = at(acc_, adt_, {c, nq_, dim_}), part_dq = at(part_q_, cdt_, {c, nq_, dim_});
  Tensor part_dk = at(part_dk_, cdt_, {c, nkv_, dim_}), part_dv = at(part_dv_, cdt_, {c, nkv_, dim_});
  Tensor dk_sum, dv_sum;
  if (lend_sums_) {
    MOP_CHECK(lent.data && lent.device == ops_.device() &&
                  sums_fit(lent.bytes(), seq, nkv_, dim_, cdt_),
              "tiled attention backward: the lent buffer ", lent.shape_str(), " does not hold the dK/dV sums");
    const int64_t n = seq * nkv_ * dim_;
    Tensor flat(lent.data, adt_, {2 * n}, lent.device);
    dk_sum = flat.rows(0, n).view({seq, nkv_, dim_}), dv_sum = flat.rows(n, 2 * n).view({seq, nkv_, dim_});
  } else {
    dk_sum = at(sum_dk_, adt_, {seq, nkv_, dim_}), dv_sum = at(sum_dv_, adt_, {seq, nkv_, dim_});
  }
  for (int64_t b = 0; b < batch; ++b) {
    ops_.fill(dk_sum, 0);
    ops_.fill(dv_sum, 0);
    for (int64_t i0 = 0; i0 < seq; i0 += c) {
      const int64_t q0 = b * seq + i0;
      Tensor lse_i = lse_tile(lse, seq, b, i0);
      for (int64_t j0 = 0; j0 <= i0; j0 += c) {
        const int64_t k0 = b * seq + j0;
        ops_.attention_bwd(part_dq, part_dk, part_dv, dout.rows(q0, q0 + c), q.rows(q0, q0 + c),
                           k.rows(k0, k0 + c), v.rows(k0, k0 + c), out.rows(q0, q0 + c), lse_i, 1,
                           scale, j0 == i0);
        if (j0 == 0)
          ops_.copy(dq_sum, part_dq);
        else
          accumulate(dq_sum, part_dq);
        accumulate(dk_sum.rows(j0, j0 + c), part_dk);
        accumulate(dv_sum.rows(j0, j0 + c), part_dv);
      }
      ops_.copy(dq.rows(q0, q0 + c), dq_sum);
    }
    ops_.copy(dk.rows(b * seq, (b + 1) * seq), dk_sum);
    ops_.copy(dv.rows(b * seq, (b + 1) * seq), dv_sum);
  }
}

}  // namespace mop
