// Forward and backward of the MoE transformer over one micro-batch (see transformer.h).
// Per layer: x_mid = x + o_proj(attn(rope(qk_norm(qkv(rmsnorm(x))))));
//            x_out = x_mid + ffn(rmsnorm(x_mid)), ffn = routed experts (+ shared expert) or dense.
// The residual gradient dx flows backward in one buffer that each layer turns from ∂/∂x_out
// into ∂/∂x_in (norm backward accumulates into it).
#include "model/transformer.h"

#include <cmath>

namespace mop {

namespace {
TransformerOptions in_dtype(TransformerOptions o, DType compute) {
  o.plan.compute = compute;  // activations have the weights' dtype
  return o;
}
}  // namespace

Transformer::Transformer(const ModelLayout& layout, ParamStore& params, Ops& ops,
                         TransformerOptions options)
    : layout_(layout),
      d_(layout.dims),
      params_(params),
      ops_(ops),
      opt_(in_dtype(std::move(options), params.weight_dtype())),
      plan_(plan_activations(layout.dims, opt_.plan)),
      cdt_(params.weight_dtype()),
      adt_(acc_dtype(params.weight_dtype())),
      arena_(ops.device() == Device::CUDA ? MemKind::Device : MemKind::Host, "activations"),
      host_arena_(ops.device() == Device::CUDA ? MemKind::Pinned : MemKind::Host, "host mirrors"),
      acts_(plan_.sets),
      xs_(plan_.xs),
      s_(plan_.shared) {
  const ActivationOptions& o = opt_.plan;
  cp_ = o.cp, ep_ = o.ep, ring_ = o.ring;
  MOP_CHECK(d_.experts_local * ep_ == d_.experts, "the layout holds ", d_.experts_local,
            " experts, ep ", ep_);
  MOP_CHECK(cp_ == 1 || (opt_.comms.cp && opt_.comms.cp->size() == cp_), "cp ", cp_, " needs its comm");
  MOP_CHECK(ep_ == 1 || (opt_.comms.ep && opt_.comms.ep_host && opt_.comms.ep->size() == ep_),
            "ep ", ep_, " needs its comms");
  routed_counts_.assign(size_t(d_.num_moe_layers() * d_.experts), 0);
  held_.assign(size_t(plan_.passes), 0);
  for (const BufferSpec& b : plan_.device)
    b.within < 0 ? arena_.add(b.shape) : arena_.add_view(b.within, b.offset, b.shape);
  for (const BufferSpec& b : plan_.host) host_arena_.add(b.shape);
}

Transformer::~Transformer() = default;

void Transformer::allocate() {
  arena_.allocate();
  host_arena_.allocate();
  const ActivationOptions& o = opt_.plan;
  const ModelComms& comms = opt_.comms;
  // A stage of the embedding or the head alone has no attention.
  const bool layers = plan_.end_layer > plan_.first_layer;
  if (ring_ && layers) {
    ring_attention_ = std::make_unique<RingAttention>(*comms.cp, ops_, o.max_batch, o.max_seq, d_.heads,
                                                      d_.kv_heads, d_.head_dim, cdt_, comms.cp_ring);
  } else if (cp_ > 1 && layers) {
    MOP_CHECK(d_.heads % cp_ == 0 && d_.kv_heads % cp_ == 0, "Ulysses attention needs the heads "
              "to divide by cp");
    ulysses_ = std::make_unique<UlyssesExchange>(*comms.cp, ops_, o.max_batch, o.max_seq * cp_,
                                                 d_.heads / cp_ * d_.head_dim, cdt_);
  }
  if (!ring_ && layers)
    tiled_ = std::make_unique<TiledAttention>(ops_, o.attention_tile, int64_t(o.max_seq) * cp_,
                                              d_.heads / cp_, d_.kv_heads / cp_, d_.head_dim, cdt_,
                                              plan_.attention_sums_in_dln);
  if (ep_ > 1)
    for (int n = 0; n < plan_.num_dispatchers; ++n)
      dispatch_.push_back(std::make_unique<ExpertDispatcher>(
          *comms.ep, *comms.ep_host, ops_, d_.experts,
          receive_rows(o, o.chunk_tokens(int64_t(o.max_batch) * o.max_seq) * d_.top_k), o.moe_chunks,
          comms.ep_dispatch, comms.ep_combine));
  if (o.recompute) saved_ = std::make_unique<SavedActivations>(ops_, plan_, arena_, host_arena_);
  OpShapes shapes;
  shapes.max_tokens = int64_t(o.max_batch) * o.max_seq;
  if (ring_) {  // c×c blocks of one sequence, all heads, causal and full
    shapes.batch = 1, shapes.seq = o.max_seq / 2, shapes.attention_non_causal = true;
    shapes.heads = d_.heads, shapes.kv_heads = d_.kv_heads;
  } else {  // Ulysses: attention sees whole sequences, heads/cp of them
    shapes.batch = o.max_batch, shapes.seq = int64_t(o.max_seq) * cp_;
    shapes.heads = d_.heads / cp_, shapes.kv_heads = d_.kv_heads / cp_;
    if (TiledAttention::tiled(o.attention_tile, shapes.seq))  // c×c blocks, causal and full
      shapes.batch = 1, shapes.seq = o.attention_tile, shapes.attention_non_causal = true;
  }
  shapes.head_dim = d_.head_dim;
  shapes.hidden = d_.hidden, shapes.experts = d_.experts, shapes.top_k = d_.top_k;
  shapes.expert_ffn = d_.expert_ffn, shapes.vocab = d_.vocab;
  shapes.lm_head_chunk = std::min<int64_t>(o.lm_head_chunk, shapes.max_tokens);  // lm_ws's rows
  ops_.prepare(shapes);
}

Tensor Transformer::act(int slot, int64_t rows) const { return dev(slot).rows(0, rows); }

Tensor Transformer::scratch(int slot, std::initializer_list<int64_t> dims) const {
  Tensor whole = dev(slot);
  Tensor shaped(nullptr, whole.dtype, dims, whole.device);
  return whole.view({whole.numel()}).rows(0, shaped.numel()).view(dims);
}

const Transformer::Acts& Transformer::acts(int l) const {
  return acts_[opt_.plan.recompute ? 0 : size_t(l - plan_.first_layer)];
}

ExpertDispatcher& Transformer::dispatcher(const Acts& a) {
  const size_t set = size_t(&a - acts_.data());
  return *dispatch_[plan_.sets_per_pass ? size_t(bank_) * acts_.size() + set : set];
}

Tensor Transformer::attn_of(int l, const Acts& a, int64_t T) const {
  const int slot = plan_.attn_saved[size_t(l)];
  return act(slot >= 0 ? slot : a.attn, T);
}

Tensor Transformer::lse_of(int l, const Acts& a, int64_t T) const {
  const int slot = plan_.lse_saved[size_t(l)];
  return act(slot >= 0 ? slot : a.lse, T * d_.heads);
}

// A dense FFN over T tokens, in chunks of the plan's MoE chunk: x_out += down(swiglu(gate_up(x))).
void Transformer::ffn_fwd(int gate_up, int down, int gu_slot, int h_slot, Tensor x, Tensor x_out,
                          int64_t T) {
  const int64_t C = opt_.plan.chunk_tokens(T);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t n = std::min(C, T - t0);
    Tensor gu = act(gu_slot, n), h = act(h_slot, n);
    ops_.gemm(gu, x.rows(t0, t0 + n), false, W(gate_up), true, 1, 0);  // [n,2F] = x·W[2F,H]ᵀ
    ops_.swiglu_fwd(h, gu);
    ops_.gemm(x_out.rows(t0, t0 + n), h, false, W(down), true, 1, 1);  // x_out += h[n,F]·W[H,F]ᵀ
  }
}

// Its backward; chunk by chunk, a chunked FFN first recomputes the chunk's gate/up and SwiGLU.
void Transformer::ffn_bwd(int gate_up, int down, int gu_slot, int h_slot, Tensor x, Tensor dy,
                          Tensor dx, int64_t T) {
  const int64_t C = opt_.plan.chunk_tokens(T);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t n = std::min(C, T - t0);
    Tensor gu = act(gu_slot, n), h = act(h_slot, n), xc = x.rows(t0, t0 + n), dyc = dy.rows(t0, t0 + n);
    if (C < T) {
      ops_.gemm(gu, xc, false, W(gate_up), true, 1, 0);
      ops_.swiglu_fwd(h, gu);
    }
    const int64_t F = h.shape[1];
    Tensor dh = scratch(s_.dffn_h, {n, F}), dgu = scratch(s_.dffn_gu, {n, 2 * F});
    ops_.gemm(dh, dyc, false, W(down), false, 1, 0);  // [n,F] = dy[n,H]·W[H,F]
    ops_.gemm(G(down), dyc, true, h, false, 1, 1);    // dW[H,F] += dyᵀ·h
    ops_.swiglu_bwd(dgu, dh, gu);
    ops_.gemm(dx.rows(t0, t0 + n), dgu, false, W(gate_up), false, 1, 1);  // dx += dgu[n,2F]·W[2F,H]
    ops_.gemm(G(gate_up), dgu, true, xc, false, 1, 1);
  }
}

// Experts [k.e0, k.e1) on rows [k.row0, k.row0 + k.rows) of the local expert-major layout: x, y
// (and the layer's gu, h) hold every local row; the weights are sliced to the chunk's experts.
void Transformer::experts_fwd(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                              const Tensor& x, Tensor y) {
  const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
  experts_gate_up(P, a, k, x);
  ops_.grouped_gemm_fwd(y.rows(r0, r1), dev(a.h).rows(r0, r1),
                        W(P.experts_down).rows(k.e0, k.e1), k.offsets);
}

// The experts' gate/up projection and SwiGLU into the layer's gu and h (the chunk's rows).
void Transformer::experts_gate_up(const LayerParams& P, const Acts& a,
                                  const ExpertDispatcher::Chunk& k, const Tensor& x) {
  const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
  Tensor gu = dev(a.gu).rows(r0, r1), h = dev(a.h).rows(r0, r1);
  ops_.grouped_gemm_fwd(gu, x.rows(r0, r1), W(P.experts_gate_up).rows(k.e0, k.e1), k.offsets);
  ops_.swiglu_fwd(h, gu);
}

void Transformer::experts_bwd(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                              const Tensor& x, const Tensor& dy, Tensor dx, bool write) {
  const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
  Tensor gu = dev(a.gu).rows(r0, r1), h = dev(a.h).rows(r0, r1);
  Tensor dh = dev(s_.dh).rows(r0, r1), dgu = dev(s_.dgu).rows(r0, r1);
  Tensor dyk = dy.rows(r0, r1), xk = x.rows(r0, r1);
  ops_.grouped_gemm_bwd_data(dh, dyk, W(P.experts_down).rows(k.e0, k.e1), k.offsets);
  ops_.grouped_gemm_bwd_weight(G(P.experts_down).rows(k.e0, k.e1), dyk, h, k.offsets, !write);
  ops_.swiglu_bwd(dgu, dh, gu);
  ops_.grouped_gemm_bwd_data(dx.rows(r0, r1), dgu, W(P.experts_gate_up).rows(k.e0, k.e1), k.offsets);
  ops_.grouped_gemm_bwd_weight(G(P.experts_gate_up).rows(k.e0, k.e1), dgu, xk, k.offsets, !write);
}

// The routed experts on `rows` permuted rows xp → yp (their group sizes on the host): this rank's
// experts, on rows from every rank of the ep group (ep = 1: all of them, locally).
void Transformer::routed_fwd(int l, const LayerParams& P, const Acts& a, const Tensor& offsets_host,
                             Tensor xp, Tensor yp) {
  if (ep_ > 1) {
    ExpertDispatcher& disp = dispatcher(a);
    std::vector<int32_t> per_expert(size_t(d_.experts));
    const int32_t* off = offsets_host.ptr<int32_t>();
    for (int64_t e = 0; e < d_.experts; ++e) per_expert[size_t(e)] = off[e + 1] - off[e];
    disp.plan(per_expert.data(), int(l - d_.first_dense));
    const int64_t rows = disp.rows_held();
    Tensor xpl = act(a.xp_local, rows), ypl = act(a.yp_local, rows);
    disp.run(xp, yp, xpl, ypl, dev(s_.dispatch_scratch),
             [&](const ExpertDispatcher::Chunk& k) { experts_fwd(P, a, k, xpl, ypl); });
  } else {
    experts_fwd(P, a, {0, d_.experts_local, 0, xp.shape[0], offsets_host}, xp, yp);
  }
}

// The backward of routed_fwd's last call: dyp → dxp (ep > 1: the forward's plan, the same rows
// travelling back the other way).
void Transformer::routed_bwd(const LayerParams& P, const Acts& a, const Tensor& offsets_host,
                             const Tensor& xp, const Tensor& dyp, Tensor dxp, bool write) {
  if (ep_ > 1) {
    ExpertDispatcher& disp = dispatcher(a);
    const int64_t rows = disp.rows_held();
    Tensor dypl = act(s_.dyp_local, rows), dxpl = act(s_.dxp_local, rows), xpl = act(a.xp_local, rows);
    if (disp.num_rounds() > 1) {
      // Rounds: the forward kept its last round's intermediates only. Each round's input rows
      // travel again with their output gradients and the experts recompute gate/up and SwiGLU
      // before their backward. A round may hold part of an expert's rows, so the weight
      // gradients add up round by round, from zeros where this call writes them (on the CPU
      // bitwise the same as writing: the sums start from +0 either way, ops.h).
      if (write) {
        ops_.fill(G(P.experts_down), 0);
        ops_.fill(G(P.experts_gate_up), 0);
      }
      disp.run(dyp, dxp, dypl, dxpl, dev(s_.dispatch_scratch),
               [&](const ExpertDispatcher::Chunk& k) {
                 experts_gate_up(P, a, k, xpl);
                 experts_bwd(P, a, k, xpl, dypl, dxpl, false);
               },
               &xp, xpl);
      return;
    }
    // The dispatcher skips a chunk without rows: written gradients of its experts are zeros.
    for (int c = 0; write && c < disp.num_chunks(); ++c) {
      const ExpertDispatcher::Chunk k = disp.chunk(c);
      if (k.rows) continue;
      ops_.fill(G(P.experts_down).rows(k.e0, k.e1), 0);
      ops_.fill(G(P.experts_gate_up).rows(k.e0, k.e1), 0);
    }
    disp.run(dyp, dxp, dypl, dxpl, dev(s_.dispatch_scratch),
             [&](const ExpertDispatcher::Chunk& k) { experts_bwd(P, a, k, xpl, dypl, dxpl, write); });
  } else {
    experts_bwd(P, a, {0, d_.experts_local, 0, xp.shape[0], offsets_host}, xp, dyp, dxp, write);
  }
}

// Tokens [t0, t0 + n) of a chunked MoE block: their route plan (group sizes to the host), their
// rows permuted into xp, and the experts' output in yp (returned).
Tensor Transformer::chunk_experts_fwd(int l, const LayerParams& P, const Acts& a, int64_t T, int64_t t0,
                                      int64_t n) {
  const int64_t nK = n * d_.top_k;
  Tensor offsets = dev(a.c_offsets), offsets_host = mirror(a.c_offsets_host);
  ops_.moe_route_plan(dev(a.c_counts), offsets, act(a.c_perm_src, nK), act(a.c_slot_of, nK),
                      act(a.topk_idx, T).rows(t0, t0 + n));
  ops_.copy(offsets_host, offsets);
  Tensor xp = act(a.xp, nK), yp = act(a.yp, nK);
  ops_.moe_permute_fwd(xp, act(a.ln2, T).rows(t0, t0 + n), act(a.c_perm_src, nK));
  routed_fwd(l, P, a, offsets_host, xp, yp);
  return yp;
}

// Router → dispatch → experts → combine. The router and its losses run over all T tokens; with a
// chunked plan the experts (and the shared expert) run chunk by chunk, and not at all when
// `experts` is false (a recomputing layer: its backward recomputes each chunk).
void Transformer::moe_fwd(int l, const Acts& a, int64_t T, Tensor x_out, Tensor losses,
                          float aux_scale, bool experts, bool count) {
  const LayerParams& P = layout_.layers[l];
  const int64_t K = d_.top_k, TK = T * K;
  const bool chunked = opt_.plan.chunked(T);
  Tensor ln2 = act(a.ln2, T), logits = act(a.logits, T), probs = act(a.probs, T);
  Tensor topk_idx = act(a.topk_idx, T), topk_w = act(a.topk_w, T), rlse = act(a.rlse, T);
  Tensor counts = dev(a.counts), offsets = dev(a.offsets);
  Tensor perm_src = act(a.perm_src, TK), slot_of = act(a.slot_of, TK);
  ops_.gemm(logits, ln2, false, W(P.router), true, 1, 0);  // fp32 router logits [T,E]
  ops_.router_fwd(topk_idx, topk_w, probs, rlse, logits, d_.renormalize);
  ops_.moe_route_plan(counts, offsets, perm_src, slot_of, topk_idx);
  // The group sizes are needed on the host (one small device→host copy per MoE layer, or chunk).
  Tensor offsets_host = mirror(a.offsets_host);
  if (!chunked) ops_.copy(offsets_host, offsets);
  // Router losses over the micro-batch's whole sequences: with cp ranks, over their tokens
  // together. The op's terms use its local T; with counts summed over the cp group, scaling the
  // coefficients by 1/cp² (aux) and 1/cp (z) makes each rank's share exactly its part of the
  // global terms (T_global = cp·T), so the shares add up over the group.
  Tensor loss_counts = counts;
  if (cp_ > 1) {
    loss_counts = dev(s_.counts_global);
    ops_.copy(loss_counts, counts);
    opt_.comms.cp->all_reduce_sum(loss_counts);
  }
  float layer_w = aux_scale / float(d_.num_moe_layers());
  ops_.moe_aux_loss(losses, dev(a.aux_grad), probs, rlse, loss_counts, int(K),
                    float(d_.aux_coef) * layer_w / float(cp_ * cp_), float(d_.z_coef) * layer_w / float(cp_));
  // Counting: the tokens once a pass (at the model's first MoE layer), the rows per expert from the
  // offsets the experts need on the host anyway (whole, or chunk by chunk).
  if (count && l == d_.first_dense) routed_tokens_ += T;  // (the stage that runs it)
  if (!experts) return;
  if (!chunked) {
    if (count) count_routed(l, offsets_host);
    Tensor xp = act(a.xp, TK), yp = act(a.yp, TK);
    ops_.moe_permute_fwd(xp, ln2, perm_src);
    routed_fwd(l, P, a, offsets_host, xp, yp);
    ops_.moe_unpermute_fwd(x_out, yp, slot_of, topk_w, /*accumulate=*/true);
    if (d_.shared_ffn) ffn_fwd(P.shared_gate_up, P.shared_down, a.shared_gu, a.shared_h, ln2, x_out, T);
    return;
  }
  const int64_t C = opt_.plan.chunk_tokens(T);
  for (int64_t t0 = 0; t0 < T; t0 += C) {
    const int64_t n = std::min(C, T - t0);
    Tensor yp = chunk_experts_fwd(l, P, a, T, t0, n);
    if (count) count_routed(l, mirror(a.c_offsets_host));
    ops_.moe_unpermute_fwd(x_out.rows(t0, t0 + n), yp, act(a.c_slot_of, n * K), topk_w.rows(t0, t0 + n),
                           /*accumulate=*/true);
    if (d_.shared_ffn)
      ffn_fwd(P.shared_gate_up, P.shared_down, a.shared_gu, a.shared_h, ln2.rows(t0, t0 + n),
              x_out.rows(t0, t0 + n), n);
  }
}

void Transformer::count_routed(int l, const Tensor& offsets_host) {
  const int32_t* off = offsets_host.ptr<int32_t>();
  int64_t* c = routed_counts_.data() + (l - d_.first_dense) * d_.experts;
  for (int64_t e = 0; e < d_.experts; ++e) c[e] += off[e + 1] - off[e];
}

void Transformer::moe_bwd(int l, const Acts& a, int64_t T, Tensor dx, Tensor dln, float aux_scale) {
  const LayerParams& P = layout_.layers[l];
  const int64_t K = d_.top_k, TK = T * K;
  Tensor ln2 = act(a.ln2, T), topk_w = act(a.topk_w, T), dtopk_w = act(s_.dtopk_w, T);
  if (!opt_.plan.chunked(T)) {
    Tensor slot_of = act(a.slot_of, TK), yp = act(a.yp, TK), dyp = act(s_.dyp, TK), dxp = act(s_.dxp, TK);
    ops_.moe_unpermute_bwd(dyp, dtopk_w, dx, yp, slot_of, topk_w);
    routed_bwd(P, a, mirror(a.offsets_host), act(a.xp, TK), dyp, dxp, write_experts_);
    ops_.moe_permute_bwd(dln, dxp, slot_of, int(K), /*accumulate=*/false);
  } else {
    // Chunk by chunk: the chunk's experts again (their activations were not kept), then their
    // backward; the combine weights' gradients and dln fill in row by row.
    const int64_t C = opt_.plan.chunk_tokens(T);
    for (int64_t t0 = 0; t0 < T; t0 += C) {
      const int64_t n = std::min(C, T - t0), nK = n * K;
      Tensor yp = chunk_experts_fwd(l, P, a, T, t0, n), slot_of = act(a.c_slot_of, nK);
      Tensor dyp = act(s_.dyp, nK), dxp = act(s_.dxp, nK);
      ops_.moe_unpermute_bwd(dyp, dtopk_w.rows(t0, t0 + n), dx.rows(t0, t0 + n), yp, slot_of,
                             topk_w.rows(t0, t0 + n));
      // The first chunk writes the experts' gradients (with write_experts_), the others add.
      routed_bwd(P, a, mirror(a.c_offsets_host), act(a.xp, nK), dyp, dxp,
                 write_experts_ && t0 == 0);
      ops_.moe_permute_bwd(dln.rows(t0, t0 + n), dxp, slot_of, int(K), /*accumulate=*/false);
    }
  }
  // Router: through the combine weights, the load-balancing loss and the z-loss (over the cp
  // group's T·cp tokens, as in the forward).
  Tensor dlogits = act(s_.dlogits, T), dlogits_c = act(s_.dlogits_c, T);
  float z_scale = float(d_.z_coef) * aux_scale / float(d_.num_moe_layers()) / float(T * cp_);
  ops_.router_bwd(dlogits, dtopk_w, act(a.probs, T), act(a.rlse, T), act(a.topk_idx, T), topk_w,
                  dev(a.aux_grad), z_scale, d_.renormalize);
  ops_.copy(dlogits_c, dlogits);
  ops_.gemm(dln, dlogits_c, false, W(P.router), false, 1, 1);  // dln[T,H] += dlogits[T,E]·Wr[E,H]
  ops_.gemm(G(P.router), dlogits_c, true, ln2, false, 1, 1);
  if (d_.shared_ffn) ffn_bwd(P.shared_gate_up, P.shared_down, a.shared_gu, a.shared_h, ln2, dx, dln, T);
}

// Sequence-parallel attention. Ring: K/V blocks travel around the cp ranks (ring_attention.h).
// Ulysses: trade token shards for head shards, attend over whole sequences, trade back
// (sequence_parallel.h); the exchanged tensors hold the same number of elements in both layouts.
// T is this rank's token count.
void Transformer::attention_fwd(const Acts& a, const Batch& b, int64_t T, Tensor attn, Tensor lse) {
  const int64_t D = d_.head_dim, Nq = d_.heads, Nkv = d_.kv_heads, S = int64_t(b.seq) * cp_;
  const int64_t rows = int64_t(b.batch) * S;
  const float scale = float(1.0 / std::sqrt(double(D)));
  if (ring_) {
    ring_attention_->forward(attn.view({T, Nq, D}), lse,
                             act(a.q, T).view({T, Nq, D}), act(a.k, T).view({T, Nkv, D}),
                             act(a.v, T).view({T, Nkv, D}), b.batch, scale);
    return;
  }
  Tensor qf = act(a.q_full, T), kf = act(a.k_full, T), vf = act(a.v_full, T), of = act(a.attn_full, T);
  ulysses_->to_full(qf, act(a.q, T), Nq);
  ulysses_->to_full(kf, act(a.k, T), Nkv);
  ulysses_->to_full(vf, act(a.v, T), Nkv);
  tiled_->forward(of.view({rows, Nq / cp_, D}), lse, qf.view({rows, Nq / cp_, D}),
                  kf.view({rows, Nkv / cp_, D}), vf.view({rows, Nkv / cp_, D}), b.batch, scale);
  ulysses_->to_local(attn, of, Nq);
}

void Transformer::attention_bwd(const Acts& a, const Batch& b, int64_t T, const Tensor& attn,
                                const Tensor& lse) {
  const int64_t D = d_.head_dim, Nq = d_.heads, Nkv = d_.kv_heads, S = int64_t(b.seq) * cp_;
  const int64_t rows = int64_t(b.batch) * S;
  const float scale = float(1.0 / std::sqrt(double(D)));
  if (ring_) {
    ring_attention_->backward(act(s_.dq, T).view({T, Nq, D}), act(s_.dk, T).view({T, Nkv, D}),
                              act(s_.dv, T).view({T, Nkv, D}), act(s_.dattn, T).view({T, Nq, D}),
                              act(a.q, T).view({T, Nq, D}), act(a.k, T).view({T, Nkv, D}),
                              act(a.v, T).view({T, Nkv, D}), attn.view({T, Nq, D}), lse, b.batch,
                              scale);
    return;
  }
  Tensor dof = act(s_.dattn_full, T), dqf = act(s_.dq_full, T), dkf = act(s_.dk_full, T);
  Tensor dvf = act(s_.dv_full, T);
  ulysses_->to_full(dof, act(s_.dattn, T), Nq);
  tiled_->backward(dqf.view({rows, Nq / cp_, D}), dkf.view({rows, Nkv / cp_, D}),
                   dvf.view({rows, Nkv / cp_, D}), dof.view({rows, Nq / cp_, D}),
                   act(a.q_full, T).view({rows, Nq / cp_, D}), act(a.k_full, T).view({rows, Nkv / cp_, D}),
                   act(a.v_full, T).view({rows, Nkv / cp_, D}), act(a.attn_full, T).view({rows, Nq / cp_, D}),
                   lse, b.batch, scale, dev(s_.dln));  // dln: dead until the q/k/v backward
  ulysses_->to_local(act(s_.dq, T), dqf, Nq);
  ulysses_->to_local(act(s_.dk, T), dkf, Nkv);
  ulysses_->to_local(act(s_.dv, T), dvf, Nkv);
}

// One layer's forward. A recomputing layer (recompute: true, refilling the activation set for its
// backward) skips what its backward does not read or recomputes itself: a kept attention output,
// and with a chunked plan the FFN or experts and the layer's output.
void Transformer::layer_fwd(int l, const Acts& a, const Batch& b, Tensor x_in, Tensor x_out,
                            Tensor losses, float aux_scale, bool recompute) {
  const LayerParams& P = layout_.layers[l];
  const int64_t T = int64_t(b.batch) * b.seq, D = d_.head_dim, Nq = d_.heads, Nkv = d_.kv_heads;
  const float eps = float(d_.rms_eps), theta = float(d_.rope_theta);
  Tensor ln1 = act(a.ln1, T), q_raw = act(a.q_raw, T), k_raw = act(a.k_raw, T);
  Tensor q = act(a.q, T), k = act(a.k, T), v = act(a.v, T);
  Tensor attn = attn_of(l, a, T), lse = lse_of(l, a, T);
  Tensor x_mid = act(a.x_mid, T), ln2 = act(a.ln2, T);
  ops_.rmsnorm_fwd(ln1, act(a.rstd1, T), x_in, W(P.ln1), eps);
  ops_.gemm(q_raw, ln1, false, W(P.q), true, 1, 0);  // [T,Nq·D] = ln1·Wqᵀ
  ops_.gemm(k_raw, ln1, false, W(P.k), true, 1, 0);
  ops_.gemm(v, ln1, false, W(P.v), true, 1, 0);
  if (d_.qk_norm) {
    ops_.rmsnorm_fwd(q.view({T * Nq, D}), act(a.q_rstd, T * Nq), q_raw.view({T * Nq, D}),
                     W(P.q_norm), eps);
    ops_.rmsnorm_fwd(k.view({T * Nkv, D}), act(a.k_rstd, T * Nkv), k_raw.view({T * Nkv, D}),
                     W(P.k_norm), eps);
  } else {
    ops_.copy(q, q_raw);
    ops_.copy(k, k_raw);
  }
  Tensor q3 = q.view({T, Nq, D}), k3 = k.view({T, Nkv, D}), v3 = v.view({T, Nkv, D});
  ops_.rope_fwd(q3, b.positions, theta);
  ops_.rope_fwd(k3, b.positions, theta);
  if (recompute && saved_->attention_kept(l)) {
    saved_->restore_attention(l, attn, lse);  // kept on the host: back in the set by now
  } else {
    if (saved_ && !saved_->attention_on_device(l)) saved_->before_set_attention_written();
    // A kept tail comes back into the set; the recompute runs the query tiles before it only.
    const bool tail = recompute && saved_->tail_kept(l);
    if (tail) saved_->restore_attention(l, attn, lse);
    if (cp_ > 1) {
      attention_fwd(a, b, T, attn, lse);
    } else {
      tiled_->forward(attn.view({T, Nq, D}), lse, q3, k3, v3, b.batch,
                      float(1.0 / std::sqrt(double(D))), tail ? T - saved_->tail_rows() : T);
    }
    if (saved_ && training_ && !recompute) saved_->attention_written(l, attn, lse);
  }
  ops_.copy(x_mid, x_in);
  ops_.gemm(x_mid, attn, false, W(P.o), true, 1, 1);  // x_mid = x_in + attn·Woᵀ
  ops_.rmsnorm_fwd(ln2, act(a.rstd2, T), x_mid, W(P.ln2), eps);
  // A chunked block recomputes its chunks in backward: a recomputing layer needs only the router.
  const bool block = !(recompute && opt_.plan.chunked(T));
  if (block) ops_.copy(x_out, x_mid);
  if (d_.is_moe(l))
    moe_fwd(l, a, T, x_out, losses, aux_scale, block, training_ && !recompute);
  else if (block)
    ffn_fwd(P.ffn_gate_up, P.ffn_down, a.ffn_gu, a.ffn_h, ln2, x_out, T);
}

void Transformer::layer_bwd(int l, const Acts& a, const Batch& b, Tensor x_in, Tensor dx,
                            float aux_scale) {
  const LayerParams& P = layout_.layers[l];
  const int64_t T = int64_t(b.batch) * b.seq, D = d_.head_dim, Nq = d_.heads, Nkv = d_.kv_heads;
  const float theta = float(d_.rope_theta);
  Tensor dln = act(s_.dln, T);
  // FFN: dx holds ∂L/∂x_out; dln becomes ∂L/∂ln2, then dx becomes ∂L/∂x_mid.
  if (d_.is_moe(l)) {
    moe_bwd(l, a, T, dx, dln, aux_scale);
  } else {
    ops_.fill(dln, 0);
    ffn_bwd(P.ffn_gate_up, P.ffn_down, a.ffn_gu, a.ffn_h, act(a.ln2, T), dx, dln, T);
  }
  ops_.rmsnorm_bwd(dx, G(P.ln2), dln, act(a.x_mid, T), W(P.ln2), act(a.rstd2, T), true);
  // Attention.
  Tensor attn = attn_of(l, a, T), lse = lse_of(l, a, T), dattn = act(s_.dattn, T);
  Tensor dq = act(s_.dq, T), dk = act(s_.dk, T), dv = act(s_.dv, T);
  ops_.gemm(dattn, dx, false, W(P.o), false, 1, 0);  // [T,Nq·D] = dx[T,H]·Wo[H,Nq·D]
  ops_.gemm(G(P.o), dx, true, attn, false, 1, 1);
  Tensor q3 = act(a.q, T).view({T, Nq, D}), k3 = act(a.k, T).view({T, Nkv, D});
  if (cp_ > 1) {
    attention_bwd(a, b, T, attn, lse);
  } else {
    tiled_->backward(dq.view({T, Nq, D}), dk.view({T, Nkv, D}), dv.view({T, Nkv, D}),
                     dattn.view({T, Nq, D}), q3, k3, act(a.v, T).view({T, Nkv, D}),
                     attn.view({T, Nq, D}), lse, b.batch, float(1.0 / std::sqrt(double(D))),
                     dev(s_.dln));  // dln: dead until the q/k/v projections' backward
  }
  // The set's attn and lse are free: the previous layer's kept attention may come back into them.
  if (saved_ && l > plan_.first_layer)
    saved_->fetch_attention(l - 1, attn_of(l - 1, a, T), lse_of(l - 1, a, T));
  ops_.rope_bwd(dq.view({T, Nq, D}), b.positions, theta);
  ops_.rope_bwd(dk.view({T, Nkv, D}), b.positions, theta);
  Tensor dq_raw = dq, dk_raw = dk, ln1 = act(a.ln1, T);
  if (d_.qk_norm) {
    dq_raw = act(s_.dq_raw, T), dk_raw = act(s_.dk_raw, T);
    Tensor q_raw = act(a.q_raw, T), k_raw = act(a.k_raw, T);
    if (plan_.qk_raw_recomputed) {  // the norms' inputs again, into q and k (read by now)
      q_raw = act(a.q, T), k_raw = act(a.k, T);
      ops_.gemm(q_raw, ln1, false, W(P.q), true, 1, 0);
      ops_.gemm(k_raw, ln1, false, W(P.k), true, 1, 0);
    }
    ops_.rmsnorm_bwd(dq_raw.view({T * Nq, D}), G(P.q_norm), dq.view({T * Nq, D}),
                     q_raw.view({T * Nq, D}), W(P.q_norm), act(a.q_rstd, T * Nq), false);
    ops_.rmsnorm_bwd(dk_raw.view({T * Nkv, D}), G(P.k_norm), dk.view({T * Nkv, D}),
                     k_raw.view({T * Nkv, D}), W(P.k_norm), act(a.k_rstd, T * Nkv), false);
  }
  ops_.gemm(dln, dq_raw, false, W(P.q), false, 1, 0);  // dln[T,H] = dq·Wq + dk·Wk + dv·Wv
  ops_.gemm(dln, dk_raw, false, W(P.k), false, 1, 1);
  ops_.gemm(dln, dv, false, W(P.v), false, 1, 1);
  ops_.gemm(G(P.q), dq_raw, true, ln1, false, 1, 1);
  ops_.gemm(G(P.k), dk_raw, true, ln1, false, 1, 1);
  ops_.gemm(G(P.v), dv, true, ln1, false, 1, 1);
  ops_.rmsnorm_bwd(dx, G(P.ln1), dln, x_in, W(P.ln1), act(a.rstd1, T), true);
}

Transformer::Pass Transformer::begin(const Batch& b, float aux_scale, bool training, float ce_scale,
                                     bool write_experts, int bank) {
  const int64_t T = int64_t(b.batch) * b.seq;
  MOP_CHECK(b.batch <= opt_.plan.max_batch && b.seq <= opt_.plan.max_seq, "micro-batch ", b.batch,
            "×", b.seq, " exceeds the planned ", opt_.plan.max_batch, "×", opt_.plan.max_seq);
  MOP_CHECK(b.ids.numel() == T && b.targets.numel() == T && b.positions.numel() == T,
            "batch tensors must have B·S elements");
  MOP_CHECK(bank >= 0 && bank < plan_.passes, "bank ", bank, " of ", plan_.passes,
            " passes in flight");
  if (plan_.passes == 1) {  // a begin() ends the last pass
    held_[0] = 0, open_backward_ = -1;
  }
  MOP_CHECK(!held_[size_t(bank)], "bank ", bank, " still holds a pass whose backward has not run");
  held_[size_t(bank)] = training;
  last_T_ = int(T);
  return {b, T, aux_scale, ce_scale, training, write_experts, bank};
}

void Transformer::use(const Pass& p) {
  MOP_CHECK(p.bank >= 0 && p.bank < plan_.passes, "bank ", p.bank, " of ", plan_.passes);
  bank_ = p.bank, training_ = p.training, write_experts_ = p.write_experts;
  if (saved_) saved_->use_bank(p.bank);
}

Tensor Transformer::in_bank(int slot, const Pass& p) const {
  MOP_CHECK(p.bank >= 0 && p.bank < plan_.passes, "bank ", p.bank, " of ", plan_.passes);
  return arena_.tensor(plan_.device_slot(slot, p.bank)).rows(0, p.tokens);
}

Tensor Transformer::stage_input(const Pass& p) const {
  MOP_CHECK(first_segment() > 0, "the stage starts with the embedding: it receives no input");
  return in_bank(xs_[size_t(first_segment() - 1)], p);
}

Tensor Transformer::stage_output(const Pass& p) const {
  MOP_CHECK(end_segment() <= d_.layers + 1, "the stage ends with the head: it sends no output");
  return in_bank(xs_[size_t(end_segment() - 1)], p);
}

Tensor Transformer::stage_output_grad(const Pass& p) const {
  MOP_CHECK(end_segment() <= d_.layers + 1,
            "the stage ends with the head: it receives no gradient");
  return in_bank(s_.dx, p);
}

Tensor Transformer::stage_input_grad(const Pass& p) const {
  MOP_CHECK(first_segment() > 0, "the stage starts with the embedding: it sends no gradient");
  return in_bank(s_.dx, p);
}

// Saved inputs of host layers: each written into its stage once the stage's last occupant is on
// the host, and copied out as soon as it is written (training only).
void Transformer::forward_segment(const Pass& p, int s) {
  const Batch& b = p.batch;
  const int64_t T = p.tokens;
  const int L = int(d_.layers);
  if (s <= L && saved_) saved_->before_input_written(s);
  if (s == 0) {
    ops_.embedding_fwd(act(xs_[0], T), b.ids, W(layout_.embedding));
  } else if (s <= L) {
    const int l = s - 1;
    layer_fwd(l, acts(l), b, act(xs_[l], T), act(xs_[l + 1], T), dev(s_.losses).rows(1, 3),
              p.aux_scale, false);
  } else {
    ops_.rmsnorm_fwd(act(s_.xf, T), act(s_.rstd_f, T), act(xs_[L], T), W(layout_.final_norm),
                     float(d_.rms_eps));
    // Training: each chunk's cross-entropy gradient is known with its lse, so the head's dx and dW
    // come from the forward's logits (the backward only reads them).
    if (p.training)
      ops_.lmhead_ce_fwd_bwd(act(s_.loss_tok, T), act(s_.lse_tok, T), act(s_.dxf, T),
                             G(layout_.lm_head), act(s_.xf, T), W(layout_.lm_head), b.targets,
                             p.ce_scale, dev(s_.lm_ws));
    else
      ops_.lmhead_ce_fwd(act(s_.loss_tok, T), act(s_.lse_tok, T), act(s_.xf, T), W(layout_.lm_head),
                         b.targets, dev(s_.lm_ws));
    Tensor tmp = dev(s_.loss_tmp), ce = dev(s_.losses).rows(0, 1);
    ops_.sum(tmp, act(s_.loss_tok, T));
    ops_.add(ce, ce, tmp);
  }
  if (s <= L && saved_ && p.training) saved_->input_written(s, T);
}

void Transformer::backward_segment(const Pass& p, int s) {
  const Batch& b = p.batch;
  const int64_t T = p.tokens;
  const int L = int(d_.layers);
  Tensor dx = act(s_.dx, T);
  if (s == L + 1) {
    ops_.rmsnorm_bwd(dx, G(layout_.final_norm), act(s_.dxf, T), act(xs_[L], T),
                     W(layout_.final_norm), act(s_.rstd_f, T), false);
  } else if (s >= 1) {
    const int l = s - 1;
    if (saved_ && l == plan_.end_layer - 1) {  // the stage's last layer's saved tensors first
      saved_->fetch_input(l, T);
      saved_->fetch_attention(l, attn_of(l, acts(l), T), lse_of(l, acts(l), T));
    }
    if (opt_.plan.recompute) {
      // One layer ahead: the previous layer's input comes back while this one runs. The refill's
      // losses go to scratch (counted once), its output (unused) to dln.
      saved_->fetch_input(l - 1, T);
      saved_->wait_input(l);
      layer_fwd(l, acts(l), b, act(xs_[l], T), act(s_.scratch_out, T),
                dev(s_.scratch_losses), p.aux_scale, true);
    }
    layer_bwd(l, acts(l), b, act(xs_[l], T), dx, p.aux_scale);
  } else {
    ops_.embedding_bwd(G(layout_.embedding), b.ids, dx);
  }
  if (s == first_segment() && saved_) saved_->finish();
}

void Transformer::forward(const Pass& p, int begin, int end) {
  MOP_CHECK(first_segment() <= begin && begin <= end && end <= end_segment(),
            "forward of segments [", begin, ",", end, ") on a stage of [", first_segment(), ",",
            end_segment(), ")");
  MOP_CHECK(open_backward_ < 0, "a forward while bank ", open_backward_,
            "'s backward is under way");
  use(p);
  for (int s = begin; s < end; ++s) forward_segment(p, s);
}

void Transformer::backward(const Pass& p, int begin, int end) {
  MOP_CHECK(p.training, "backward of a pass begun without training");
  MOP_CHECK(first_segment() <= begin && begin <= end && end <= end_segment(),
            "backward of segments [", begin, ",", end, ") on a stage of [", first_segment(), ",",
            end_segment(), ")");
  MOP_CHECK(held_[size_t(p.bank)], "backward of bank ", p.bank,
            ", which holds no pass to differentiate");
  MOP_CHECK(open_backward_ < 0 || open_backward_ == p.bank, "a backward of bank ", p.bank,
            " while bank ", open_backward_, "'s is under way");
  use(p);
  open_backward_ = p.bank;
  for (int s = end - 1; s >= begin; --s) backward_segment(p, s);
  if (begin == first_segment()) open_backward_ = -1, held_[size_t(p.bank)] = 0;
}

void Transformer::forward(const Batch& b, float aux_scale) {
  MOP_CHECK(first_segment() == 0 && end_segment() == num_segments(d_),
            "a whole micro-batch's forward on a stage: a stage runs its passes by segments");
  forward(begin(b, aux_scale, false), first_segment(), end_segment());
}

void Transformer::forward_backward(const Batch& b, float ce_scale, float aux_scale,
                                   bool write_experts) {
  MOP_CHECK(first_segment() == 0 && end_segment() == num_segments(d_),
            "forward_backward runs the whole model; a stage runs its passes segment by segment");
  const Pass p = begin(b, aux_scale, true, ce_scale, write_experts);
  forward(p, 0, num_segments(d_));
  backward(p, 0, num_segments(d_));
}

LossTerms Transformer::take_losses() {
  Tensor losses = dev(s_.losses);
  double host[3];
  Tensor h(host, DType::F64, {3});
  ops_.copy(h, losses);  // CPU backend: direct; CUDA backend: device → host copy (synchronises)
  ops_.fill(losses, 0);
  return {host[0], host[1], host[2]};
}

void Transformer::logits(Tensor out, int row) {
  MOP_CHECK(row >= 0 && row < last_T_, "logits row ", row, " of ", last_T_);
  MOP_CHECK(s_.xf >= 0, "logits on a stage without the head");
  Tensor x = act(s_.xf, last_T_).rows(row, row + 1);
  ops_.gemm(out.view({1, d_.vocab}), x, false, W(layout_.lm_head), true, 1, 0);
}

}  // namespace mop
