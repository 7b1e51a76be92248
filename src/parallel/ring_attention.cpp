// Ring attention (see ring_attention.h). Buffer layout (one device allocation, each part aligned to
// kAlign bytes), with T = max_batch·max_local_seq, c = max_local_seq/2, KV = Nkv·D, Q = Nq·D:
//   packet 0, 1          each [k T·KV | v T·KV] compute; a micro-batch of T_l ≤ T tokens packs
//                        them with T_l, so what travels is contiguous
//   sums 0, 1, 2         each [dk T·KV | dv T·KV] acc, packed the same way (backward: the block
//                        being summed, the sum arriving, the sum leaving)
//   acc                  [T, Q] acc            forward: the output accumulator; backward: dq
//   part_o               [c, Q] compute        a block's output (forward) or dq (backward)
//   part_dk, part_dv     [c, KV] compute       a block's dk, dv
//   part_lse             [Nq, c] acc           a block's lse
//   conv                 [c, max(Q, KV)] acc   a block's gradient converted to acc (bf16 runs)
#include "parallel/ring_attention.h"

#include <algorithm>
#include <limits>

namespace mop {
namespace {

constexpr size_t kAlign = 256;

size_t align_up(size_t n) { return (n + kAlign - 1) / kAlign * kAlign; }

struct Layout {
  size_t packet, sum, sums, acc, part_o, part_dk, part_dv, part_lse, conv, total;
};

Layout plan_layout(int max_batch, int max_local_seq, int64_t nq, int64_t nkv, int64_t dim,
                   DType cdt) {
  const DType adt = acc_dtype(cdt);
  const size_t cs = dtype_size(cdt), as = dtype_size(adt);
  const size_t tokens = size_t(max_batch) * size_t(max_local_seq), c = size_t(max_local_seq / 2);
  const size_t q = size_t(nq * dim), kv = size_t(nkv * dim);
  Layout l{};
  l.packet = align_up(2 * tokens * kv * cs);
  l.sum = align_up(2 * tokens * kv * as);
  l.sums = 2 * l.packet;
  size_t off = l.sums + 3 * l.sum;
  l.acc = off, off += align_up(tokens * q * as);
  l.part_o = off, off += align_up(c * q * cs);
  l.part_dk = off, off += align_up(c * kv * cs);
  l.part_dv = off, off += align_up(c * kv * cs);
  l.part_lse = off, off += align_up(size_t(nq) * c * as);
  l.conv = off, off += align_up(c * std::max(q, kv) * as);
  l.total = off;
  return l;
}

}  // namespace

size_t RingAttention::buffer_bytes(int max_batch, int max_local_seq, int64_t num_q_heads,
                                   int64_t num_kv_heads, int64_t head_dim, DType dtype) {
  return plan_layout(max_batch, max_local_seq, num_q_heads, num_kv_heads, head_dim, dtype).total;
}

RingAttention::RingAttention(Comm& cp, Ops& ops, int max_batch, int max_local_seq,
                             int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                             DType dtype, Comm* async)
    : comm_(async ? *async : cp),
      ops_(ops),
      cp_(cp.size()),
      rank_(cp.rank()),
      max_batch_(max_batch),
      max_local_seq_(max_local_seq),
      nq_(num_q_heads),
      nkv_(num_kv_heads),
      dim_(head_dim),
      cdt_(dtype),
      adt_(acc_dtype(dtype)) {
  MOP_CHECK(max_local_seq % 2 == 0, "ring attention: ", max_local_seq,
            " local tokens per sequence do not split into an early and a late chunk");
  MOP_CHECK(nkv_ > 0 && nq_ % nkv_ == 0, "ring attention: ", nq_, " query heads over ", nkv_,
            " kv heads");
  // The GPU backend runs one-token attention through a path that takes the block's softmax to be
  // its own (cuDNN rejects S = 1), which a ring block's is not.
  MOP_USER_CHECK(ops.device() == Device::CPU || max_local_seq >= 4, "ring attention on the GPU "
                 "needs chunks of at least 2 tokens: data.seq_len must be at least 4 × "
                 "parallel.attention.cp (", 2 * cp_, " × ", max_local_seq / 2, " given)");
  Layout l = plan_layout(max_batch, max_local_seq, nq_, nkv_, dim_, cdt_);
  packet_bytes_ = l.packet, sum_bytes_ = l.sum, sums_off_ = l.sums, acc_off_ = l.acc, part_o_off_ = l.part_o;
  part_dk_off_ = l.part_dk;
  part_dv_off_ = l.part_dv, part_lse_off_ = l.part_lse, conv_off_ = l.conv;
  buffer_ = Buffer(ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host, l.total);
}

Tensor RingAttention::at(size_t offset, DType dtype, std::initializer_list<int64_t> dims) const {
  return Tensor(static_cast<char*>(buffer_.data()) + offset, dtype, dims, ops_.device());
}

Tensor RingAttention::packet_kv(int p, int which, int64_t tokens) const {
  const size_t n = size_t(tokens * nkv_ * dim_);
  return at(size_t(p) * packet_bytes_ + size_t(which) * n * dtype_size(cdt_), cdt_,
            {tokens, nkv_, dim_});
}

Tensor RingAttention::packet(int p, int64_t tokens) const {
  return at(size_t(p) * packet_bytes_, DType::U8, {2 * tokens * nkv_ * dim_ * int64_t(dtype_size(cdt_))});
}

Tensor RingAttention::sum_dkv(int i, int which, int64_t tokens) const {
  const size_t n = size_t(tokens * nkv_ * dim_);
  return at(sums_off_ + size_t(i) * sum_bytes_ + size_t(which) * n * dtype_size(adt_), adt_,
            {tokens, nkv_, dim_});
}

Tensor RingAttention::sum(int i, int64_t tokens) const {
  Tensor dk = sum_dkv(i, 0, tokens);
  return Tensor(dk.data, DType::U8, {2 * tokens * nkv_ * dim_ * int64_t(dtype_size(adt_))}, dk.device);
}

int RingAttention::blocks_of(int j, Block* out) const {
  int n = 0;
  if (j <= rank_) out[n++] = {0, 0, j == rank_};  // early q × early kv
  out[n++] = {1, 0, false};                        // late q × early kv
  if (j >= rank_) out[n++] = {1, 1, j == rank_};   // late q × late kv
  return n;
}

void RingAttention::accumulate(Tensor acc, const Tensor& part) {
  const int64_t n = part.numel();
  MOP_CHECK(acc.numel() == n, "ring attention: accumulate ", part.shape_str(), " into ",
            acc.shape_str());
  Tensor flat = acc.view({n});
  if (part.dtype == acc.dtype) {
    ops_.add(flat, flat, part.view({n}));
    return;
  }
  Tensor conv = at(conv_off_, adt_, {n});
  ops_.copy(conv, part.view({n}));
  ops_.add(flat, flat, conv);
}

Tensor RingAttention::check(const Tensor& q, const Tensor& k, const Tensor& lse, int batch,
                            const char* op) const {
  MOP_CHECK(batch > 0 && batch <= max_batch_ && q.ndim == 3 && q.shape[0] % (2 * batch) == 0,
            op, ": q ", q.shape_str(), " is not [batch·2c, Nq, D] of ", batch, " sequences");
  const int64_t local_seq = q.shape[0] / batch;
  MOP_CHECK(local_seq <= max_local_seq_ && q.shape[1] == nq_ && q.shape[2] == dim_ &&
                k.ndim == 3 && k.shape[0] == q.shape[0] && k.shape[1] == nkv_ && k.shape[2] == dim_,
            op, ": q ", q.shape_str(), ", k ", k.shape_str(), " against the planned ", max_batch_,
            "×", max_local_seq_, " tokens, ", nq_, "/", nkv_, " heads of ", dim_);
  MOP_CHECK(q.dtype == cdt_ && k.dtype == cdt_, op, ": dtype ", dtype_name(q.dtype));
  const int64_t c = local_seq / 2;
  MOP_CHECK(lse.dtype == adt_ && lse.numel() == 2 * batch * nq_ * c, op, ": lse ", lse.shape_str());
  return lse.view({2 * int64_t(batch), nq_, c});  // lse block (b, half) is [Nq, c]
}

void RingAttention::forward(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                            const Tensor& v, int batch, float scale) {
  Tensor lse_blocks = check(q, k, lse, batch, "ring attention forward");
  const int64_t tokens = q.shape[0], c = tokens / batch / 2;
  const int prev = (rank_ + cp_ - 1) % cp_, next = (rank_ + 1) % cp_;
  Tensor acc = at(acc_off_, adt_, {tokens, nq_, dim_});
  Tensor part_o = at(part_o_off_, cdt_, {c, nq_, dim_}), part_lse = at(part_lse_off_, adt_, {1, nq_, c});
  // lse = −inf: every query starts with an empty accumulator (its first merge ignores acc).
  ops_.fill(lse, -std::numeric_limits<double>::infinity());
  ops_.copy(packet_kv(0, 0, tokens), k);
  ops_.copy(packet_kv(0, 1, tokens), v);
  int cur = 0;
  for (int step = 0; step < cp_; ++step) {
    // The next step's K/V travel while this step's blocks compute (an asynchronous comm on GPUs;
    // a blocking one first moves them, then the blocks run).
    if (step + 1 < cp_) comm_.send_recv(packet(1 - cur, tokens), prev, packet(cur, tokens), next);
    const int j = (rank_ - step + cp_) % cp_;
    Block blocks[3];
    const int num_blocks = blocks_of(j, blocks);
    Tensor kb = packet_kv(cur, 0, tokens), vb = packet_kv(cur, 1, tokens);
    for (int64_t b = 0; b < batch; ++b)
      for (int i = 0; i < num_blocks; ++i) {
        const Block& blk = blocks[i];
        const int64_t q0 = (2 * b + blk.q_late) * c, k0 = (2 * b + blk.kv_late) * c;
        ops_.attention_fwd(part_o, part_lse, q.rows(q0, q0 + c), kb.rows(k0, k0 + c),
                           vb.rows(k0, k0 + c), 1, scale, blk.causal);
        ops_.attention_merge(acc.rows(q0, q0 + c), lse_blocks.rows(2 * b + blk.q_late, 2 * b + blk.q_late + 1),
                             part_o, part_lse, 1);
      }
    comm_.join();
    cur = 1 - cur;
  }
  ops_.copy(out, acc);
}

void RingAttention::backward(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             int batch, float scale) {
  Tensor lse_blocks = check(q, k, lse, batch, "ring attention backward");
  const int64_t tokens = q.shape[0], c = tokens / batch / 2;
  const int prev = (rank_ + cp_ - 1) % cp_, next = (rank_ + 1) % cp_;
  Tensor dq_acc = at(acc_off_, adt_, {tokens, nq_, dim_});
  Tensor part_dq = at(part_o_off_, cdt_, {c, nq_, dim_});
  Tensor part_dk = at(part_dk_off_, cdt_, {c, nkv_, dim_}), part_dv = at(part_dv_off_, cdt_, {c, nkv_, dim_});
  ops_.fill(dq_acc, 0);
  ops_.copy(packet_kv(0, 0, tokens), k);
  ops_.copy(packet_kv(0, 1, tokens), v);
  // The dK/dV sum of the K/V block j held at a step: this rank's blocks against j go into `part`
  // (from zero) while the sum of the ranks before it arrives in `arriving`; their total leaves for
  // the next rank during the next step (from `leaving`). At step s ≥ 1 this rank holds j = r − s,
  // whose sum its predecessor completed at step s − 1, so the sums travel one step behind K/V.
  int part = 0, leaving = 1;
  const int arriving = 2;
  int cur = 0;
  for (int step = 0; step < cp_; ++step) {
    const int j = (rank_ - step + cp_) % cp_;
    if (step + 1 < cp_) comm_.send_recv(packet(1 - cur, tokens), prev, packet(cur, tokens), next);
    if (step > 0) comm_.send_recv(sum(arriving, tokens), prev, sum(leaving, tokens), next);
    Block blocks[3];
    const int num_blocks = blocks_of(j, blocks);
    Tensor kb = packet_kv(cur, 0, tokens), vb = packet_kv(cur, 1, tokens);
    Tensor dkb = sum_dkv(part, 0, tokens), dvb = sum_dkv(part, 1, tokens);
    ops_.fill(dkb, 0);
    ops_.fill(dvb, 0);
    for (int64_t b = 0; b < batch; ++b)
      for (int i = 0; i < num_blocks; ++i) {
        const Block& blk = blocks[i];
        const int64_t q0 = (2 * b + blk.q_late) * c, k0 = (2 * b + blk.kv_late) * c;
        ops_.attention_bwd(part_dq, part_dk, part_dv, dout.rows(q0, q0 + c), q.rows(q0, q0 + c),
                           kb.rows(k0, k0 + c), vb.rows(k0, k0 + c), out.rows(q0, q0 + c),
                           lse_blocks.rows(2 * b + blk.q_late, 2 * b + blk.q_late + 1), 1, scale,
                           blk.causal);
        accumulate(dq_acc.rows(q0, q0 + c), part_dq);
        accumulate(dkb.rows(k0, k0 + c), part_dk);
        accumulate(dvb.rows(k0, k0 + c), part_dv);
      }
    comm_.join();
    if (step > 0) {
      for (int which : {0, 1}) {
        Tensor mine = sum_dkv(part, which, tokens).view({tokens * nkv_ * dim_});
        ops_.add(mine, mine, sum_dkv(arriving, which, tokens).view({tokens * nkv_ * dim_}));
      }
    }
    std::swap(part, leaving);
    cur = 1 - cur;
  }
  // The last sums (of j = r + 1 − cp ≡ next) make one more hop, and this rank's own arrive; with
  // one rank they are home already.
  int home = leaving;
  if (cp_ > 1) {
    comm_.send_recv(sum(arriving, tokens), prev, sum(leaving, tokens), next);
    comm_.join();
    home = arriving;
  }
  ops_.copy(dq, dq_acc);
  ops_.copy(dk, sum_dkv(home, 0, tokens));
  ops_.copy(dv, sum_dkv(home, 1, tokens));
}

}  // namespace mop
