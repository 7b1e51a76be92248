// The activation plan (see activations.h): the buffers of one micro-batch, T = batch · local
// sequence tokens, in the order the Transformer adds them to its arena.
#include "model/activations.h"

#include <algorithm>
#include <cmath>

#include "model/tiled_attention.h"
#include "parallel/expert_dispatch.h"
#include "parallel/ring_attention.h"
#include "parallel/sequence_parallel.h"
#include "runtime/memory.h"

namespace mop {

const char* component_name(Component c) {
  switch (c) {
    case Component::Checkpoints: return "layer inputs";
    case Component::Attention: return "attention";
    case Component::Router: return "router";
    case Component::Experts: return "experts";
    case Component::DenseFfn: return "dense FFN";
    case Component::LmHead: return "LM head";
    case Component::Gradients: return "gradients";
  }
  return "?";
}

size_t ActivationLayout::arena_bytes() const {
  size_t n = 0;
  for (const BufferSpec& b : device)
    if (b.within < 0) n += align_up(b.shape.bytes());
  return n;
}

size_t ActivationLayout::host_arena_bytes() const {
  size_t n = 0;
  for (const BufferSpec& b : host) n += align_up(b.shape.bytes());
  return n;
}

std::array<size_t, kNumComponents> ActivationLayout::device_by_component() const {
  std::array<size_t, kNumComponents> out{};
  for (const BufferSpec& b : device)
    if (b.within < 0) out[size_t(b.component)] += align_up(b.shape.bytes());
  out[size_t(Component::Attention)] += attention_bytes;
  out[size_t(Component::Experts)] += dispatch_device_bytes;
  return out;
}

size_t ActivationLayout::device_bytes() const {
  return arena_bytes() + attention_bytes + dispatch_device_bytes;
}

namespace {
// Banks 1..passes-1: a copy of every per-pass buffer appended after bank 0's, a view within its
// own bank's copy of the buffer it lies in; slot_of[b][i] is bank b's slot of bank 0's slot i.
void add_banks(std::vector<BufferSpec>& specs, std::vector<std::vector<int>>& slot_of, int passes) {
  const size_t n = specs.size();
  slot_of.assign(size_t(passes), std::vector<int>(n));
  for (size_t i = 0; i < n; ++i) {
    slot_of[0][i] = int(i);
    const BufferSpec& b = specs[i];
    MOP_CHECK(b.within < 0 || specs[size_t(b.within)].per_pass == b.per_pass,
              "activation plan: a view of slot ", b.within, " in another bank");
  }
  for (size_t bank = 1; bank < size_t(passes); ++bank)
    for (size_t i = 0; i < n; ++i) {
      if (!specs[i].per_pass) {
        slot_of[bank][i] = int(i);
        continue;
      }
      const BufferSpec copy = specs[i];
      slot_of[bank][i] = int(specs.size());
      specs.push_back(copy);
    }
  for (size_t bank = 1; bank < size_t(passes); ++bank)
    for (size_t i = 0; i < n; ++i) {
      BufferSpec& b = specs[size_t(slot_of[bank][i])];
      if (specs[i].per_pass && b.within >= 0) b.within = slot_of[bank][size_t(b.within)];
    }
}
}  // namespace

int64_t exchange_rows(double budget, int64_t rows_per_rank, int ep) {
  if (budget <= 0 || ep <= 1) return 0;
  const double rows = std::ceil(budget * double(rows_per_rank));  // huge budgets: compared as doubles
  if (rows >= double(rows_per_rank) * ep) return 0;
  return std::max<int64_t>(1, int64_t(rows));
}

int64_t receive_rows(const ActivationOptions& o, int64_t rows_per_rank) {
  const int64_t worst = rows_per_rank * o.ep;
  return o.ep > 1 && o.exchange_rows > 0 ? std::min(o.exchange_rows, worst) : worst;
}

ActivationLayout plan_activations(const ModelDims& d, const ActivationOptions& o) {
  ActivationLayout L;
  const int64_t T = int64_t(o.max_batch) * o.max_seq, H = d.hidden;
  const int64_t Q = d.q_width(), KV = d.kv_width(), E = d.experts, K = d.top_k;
  const int64_t TK = T * K;
  // The MoE block and the dense FFN hold one chunk of C tokens at a time.
  const int64_t C = o.chunk_tokens(T), CK = C * K;
  const bool chunked = C < T;
  const DType cdt = o.compute, adt = acc_dtype(o.compute);
  // Dropless expert parallelism: a rank may receive every row of its ep group (ep·C·K); with an
  // exchange budget its buffers hold fewer and it takes its rows in rounds.
  const int64_t R = receive_rows(o, CK);
  MOP_CHECK(o.recompute || (o.host_layers == 0 && o.keep_attention == 0),
            "saved tensors in host memory and kept attention need recompute");
  MOP_CHECK(o.host_layers >= 0 && o.host_layers <= d.layers && o.keep_attention >= 0 &&
                o.keep_attention <= d.layers,
            "host_layers ", o.host_layers, ", keep_attention ", o.keep_attention, " of ", d.layers, " layers");
  MOP_CHECK(o.keep_attention == 0 || o.cp == 1 || o.ring, "kept attention needs cp 1 or ring attention");
  // Kept tails: the last tiles of a micro-batch of one sequence (contiguous rows of attn and lse).
  const int64_t tail_rows = o.keep_attention < d.layers ? o.keep_attention_tail * o.attention_tile : 0;
  MOP_CHECK(o.keep_attention_tail >= 0 &&
                (tail_rows == 0 || (o.recompute && o.cp == 1 && !o.ring && o.max_batch == 1 &&
                                    TiledAttention::tiled(o.attention_tile, o.max_seq) &&
                                    o.max_seq % o.attention_tile == 0 && tail_rows < o.max_seq)),
            "kept attention tails of ", o.keep_attention_tail, " tiles need recompute, cp 1, one "
            "sequence per micro-batch and fewer tiles than its ", o.max_seq, " tokens hold (tile ",
            o.attention_tile, ")");
  // The stage: its segments, the layers among them, and the layer inputs they read or write
  // (segment 0 writes x_0, layer l reads x_l and writes x_{l+1}, the head reads x_L).
  const int L_ = int(d.layers);
  L.first_segment = o.first_segment;
  L.end_segment = o.end_segment < 0 ? L_ + 2 : o.end_segment;
  MOP_CHECK(0 <= L.first_segment && L.first_segment < L.end_segment && L.end_segment <= L_ + 2,
            "a stage of segments [", o.first_segment, ",", o.end_segment, ") of ", L_ + 2);
  MOP_CHECK(o.passes_in_flight >= 1, "passes in flight: ", o.passes_in_flight);
  L.first_layer = std::max(L.first_segment, 1) - 1;
  L.end_layer = std::max(L.first_layer, std::min(L.end_segment, L_ + 1) - 1);
  const int x_lo = std::min(L.first_layer, L_), x_hi = std::min(L.end_segment - 1, L_);
  const bool head = L.end_segment == L_ + 2, layers = L.end_layer > L.first_layer;
  // Inputs of the stage's layers that may go to host memory: not a received one.
  const int host_lo = L.first_layer + (L.first_segment >= 1 ? 1 : 0);
  const auto host_input = [&](int l) {
    return l >= host_lo && l < L.end_layer && l < o.host_layers;
  };
  Component comp = Component::Checkpoints;
  bool per_pass = true;  // what the next buffers are (see passes_in_flight)
  auto add = [&](DType dt, std::initializer_list<int64_t> dims) {
    L.device.push_back({Tensor(nullptr, dt, dims), comp, per_pass});
    return int(L.device.size()) - 1;
  };
  auto host = [&](DType dt, std::initializer_list<int64_t> dims) {
    L.host.push_back({Tensor(nullptr, dt, dims), comp, per_pass});
    return int(L.host.size()) - 1;
  };
  auto c = [&](std::initializer_list<int64_t> dims) { return add(cdt, dims); };
  auto a = [&](std::initializer_list<int64_t> dims) { return add(adt, dims); };
  auto i = [&](std::initializer_list<int64_t> dims) { return add(DType::I32, dims); };

  // Saved tensors: the layer inputs (those of host layers pass through two device stages), x_L,
  // and the kept attention outputs.
  int stage[2] = {-1, -1};
  for (int l = 0; l < L_; ++l)
    if (host_input(l) && stage[l % 2] < 0) stage[l % 2] = c({T, H});
  L.xs_host.assign(size_t(L_), -1);
  L.attn_saved.assign(size_t(L_), -1), L.lse_saved.assign(size_t(L_), -1);
  L.attn_host.assign(size_t(L_), -1), L.lse_host.assign(size_t(L_), -1);
  L.tail_saved.assign(size_t(L_), -1), L.tail_lse_saved.assign(size_t(L_), -1);
  L.tail_host.assign(size_t(L_), -1), L.tail_lse_host.assign(size_t(L_), -1);
  L.tail_rows = tail_rows;
  for (int l = 0; l <= L_; ++l) {
    if (l < x_lo || l > x_hi) {
      L.xs.push_back(-1);
      continue;
    }
    if (host_input(l)) {
      L.xs.push_back(stage[l % 2]);
      L.xs_host[size_t(l)] = host(cdt, {T, H});
    } else if (l == L_ && o.host_layers == L_ && L_ >= 2 && head && host_input(L_ - 2)) {
      // Every layer's input on the host: x_L (read by the final norm, forward and backward, and
      // never copied out) takes x_{L-2}'s stage once that is on the host; x_{L-2} comes back
      // into it during layer L-1's backward, after the final norm's.
      L.xs.push_back(stage[l % 2]);
    } else {
      L.xs.push_back(c({T, H}));
    }
    if (l < L.first_layer || l >= L.end_layer) continue;
    if (l < o.keep_attention) {
      if (l < o.host_layers) {
        L.attn_host[size_t(l)] = host(cdt, {T, Q}), L.lse_host[size_t(l)] = host(adt, {T * d.heads});
      } else {
        L.attn_saved[size_t(l)] = c({T, Q}), L.lse_saved[size_t(l)] = a({T * d.heads});
      }
    } else if (l < L_ && tail_rows > 0) {
      if (l < o.host_layers) {
        L.tail_host[size_t(l)] = host(cdt, {tail_rows, Q});
        L.tail_lse_host[size_t(l)] = host(adt, {tail_rows * d.heads});
      } else {
        L.tail_saved[size_t(l)] = c({tail_rows, Q}), L.tail_lse_saved[size_t(l)] = a({tail_rows * d.heads});
      }
    }
  }
  const int sets = !layers ? 0 : o.recompute ? 1 : L.end_layer - L.first_layer;
  bool any_moe = false, any_dense = false, recomputes_attention = false;
  for (int l = L.first_layer; l < L.end_layer; ++l) {
    (d.is_moe(l) ? any_moe : any_dense) = true;
    recomputes_attention |= l >= o.keep_attention || l < o.host_layers;  // or kept on the host
  }
  // Without recompute a layer's set lives from its forward to its backward; with recompute the one
  // set is refilled before each layer's backward (and the experts re-planned).
  per_pass = L.sets_per_pass = !o.recompute;
  for (int set = 0; set < sets; ++set) {
    const int layer = L.first_layer + set;
    ActSlots s;
    comp = Component::Attention;
    s.ln1 = c({T, H}), s.rstd1 = a({T});
    if (!o.recompute) s.q_raw = c({T, Q}), s.k_raw = c({T, KV});  // else: see qk_raw_recomputed
    s.q = c({T, Q}), s.k = c({T, KV}), s.v = c({T, KV});
    s.q_rstd = a({T * d.heads}), s.k_rstd = a({T * d.kv_heads});
    // With recompute, a set's attention output is needed only while some layer recomputes its
    // attention or receives its kept one from the host.
    const bool attn_in_set = !o.recompute || recomputes_attention;
    if (attn_in_set) s.attn = c({T, Q}), s.lse = a({T * d.heads});
    // Ulysses: whole sequences, heads/cp of them. Ring attention keeps the local layout; its lse is
    // [2·batch, Nq, c] blocks, the same T·Nq elements.
    if (o.cp > 1 && !o.ring)
      s.q_full = c({T, Q}), s.k_full = c({T, KV}), s.v_full = c({T, KV}), s.attn_full = c({T, Q});
    s.x_mid = c({T, H}), s.ln2 = c({T, H}), s.rstd2 = a({T});
    // With recompute the single set serves every layer, so it needs both MoE and dense buffers;
    // without, layer `set` needs only its own kind.
    const bool moe = o.recompute ? any_moe : d.is_moe(layer);
    const bool dense = o.recompute ? any_dense : !d.is_moe(layer);
    if (moe) {
      comp = Component::Router;
      s.logits = a({T, E}), s.probs = a({T, E}), s.rlse = a({T});
      s.topk_idx = i({T, K}), s.topk_w = a({T, K});
      s.counts = i({E}), s.offsets = i({E + 1}), s.perm_src = i({TK}), s.slot_of = i({TK});
      s.aux_grad = a({E});
      s.offsets_host = host(DType::I32, {E + 1});
      if (chunked) {
        s.c_counts = i({E}), s.c_offsets = i({E + 1}), s.c_perm_src = i({CK}), s.c_slot_of = i({CK});
        s.c_offsets_host = host(DType::I32, {E + 1});
      }
      comp = Component::Experts;
      s.xp = c({CK, H}), s.gu = c({R, 2 * d.expert_ffn}), s.h = c({R, d.expert_ffn});
      s.yp = c({CK, H});
      if (o.ep > 1) s.xp_local = c({R, H}), s.yp_local = c({R, H});
      comp = Component::DenseFfn;
      if (d.shared_ffn) s.shared_gu = c({C, 2 * d.shared_ffn}), s.shared_h = c({C, d.shared_ffn});
    }
    comp = Component::DenseFfn;
    if (dense) s.ffn_gu = c({C, 2 * d.dense_ffn}), s.ffn_h = c({C, d.dense_ffn});
    L.sets.push_back(s);
  }
  SharedSlots& s = L.shared;
  per_pass = false;
  comp = Component::Gradients;
  // Attention in query tiles writes a tile's dq once it has read the tile's dout for the last
  // time, so dq shares dattn there (Ulysses: dattn is read into dattn_full before dq is written).
  const bool tiles = !o.ring && TiledAttention::tiled(o.attention_tile, int64_t(o.max_seq) * o.cp);
  s.dx = c({T, H}), s.dln = c({T, H});
  if (layers) {
    s.dattn = c({T, Q});
    s.dq = tiles ? s.dattn : c({T, Q});
    s.dk = c({T, KV}), s.dv = c({T, KV});
    // The q-norm's input gradient is written once attention's backward has read dattn (in place
    // where dq is dattn: the norm's backward reads a row before writing it).
    s.dq_raw = s.dattn, s.dk_raw = c({T, KV});
  }
  if (o.recompute && layers) {
    L.qk_raw_recomputed = true;
    L.sets[0].q_raw = s.dattn, L.sets[0].k_raw = s.dk_raw;
    // The set's x_mid and ln2 are dead wherever dattn is live: forward writes them once attention
    // has run (q_raw, dattn's use in forward, is read by then), and backward reads them last in
    // the FFN's and the second norm's backward, before the output projection's backward writes
    // dattn. So they live in dattn's bytes where those hold them (both where Q ≥ 2H, x_mid alone
    // where Q ≥ H): T·H·4 bytes less at bf16, 8 GiB at 1M tokens of q3moe-8l.
    const size_t room = L.device[size_t(s.dattn)].shape.bytes();
    size_t at = 0;
    for (int slot : {L.sets[0].x_mid, L.sets[0].ln2}) {
      BufferSpec& b = L.device[size_t(slot)];
      if (at + b.shape.bytes() > room) break;
      b.within = s.dattn, b.offset = at;
      at = align_up(at + b.shape.bytes());
    }
  }
  if (any_moe) {
    s.dlogits = a({T, E}), s.dlogits_c = c({T, E}), s.dtopk_w = a({T, K});
    s.dyp = c({CK, H}), s.dh = c({R, d.expert_ffn}), s.dgu = c({R, 2 * d.expert_ffn});
    s.dxp = c({CK, H});
    if (o.ep > 1) s.dyp_local = c({R, H}), s.dxp_local = c({R, H}), s.dispatch_scratch = c({R, H});
    if (o.cp > 1) s.counts_global = i({E});
  }
  if (o.cp > 1 && !o.ring && layers) {
    s.dattn_full = c({T, Q}), s.dq_full = tiles ? s.dattn_full : c({T, Q});
    s.dk_full = c({T, KV}), s.dv_full = c({T, KV});
  }
  // Dense-layer and shared-expert FFN gradients share one pair of buffers of the wider width.
  const int64_t ffn_w = std::max(any_dense ? d.dense_ffn : 0, any_moe ? d.shared_ffn : 0);
  if (ffn_w) s.dffn_h = c({C, ffn_w}), s.dffn_gu = c({C, 2 * ffn_w});
  comp = Component::LmHead;
  if (head) {
    // With recompute the activation set is dead between the forward and the backward: the final
    // norm's output lives in its ln1. The LM head's input gradient is dead once the final norm's
    // backward has read it, before any layer writes dln: one pass in flight keeps it there, more
    // keep it per pass (a later pass's head would overwrite it before this one's backward).
    s.xf = o.recompute && layers ? L.sets[0].ln1 : c({T, H});
    per_pass = true;
    s.rstd_f = a({T});
    s.dxf = o.passes_in_flight > 1 ? c({T, H}) : s.dln;
    per_pass = false;
    s.loss_tok = a({T}), s.lse_tok = a({T});
    s.lm_ws = a({std::min<int64_t>(o.lm_head_chunk, T), d.vocab});
  }
  s.losses = a({3});
  if (head) s.loss_tmp = a({1});
  // A recomputing layer's output (unused: the next layer's input is saved) goes to dln, which
  // its backward overwrites; a chunked block is not recomputed at all.
  s.scratch_out = o.recompute ? s.dln : -1;
  s.scratch_losses = a({2});

  if (!o.ring && layers) {
    const int64_t S = int64_t(o.max_seq) * o.cp;
    L.attention_sums_in_dln = TiledAttention::sums_fit(L.device[size_t(s.dln)].shape.bytes(), S,
                                                       d.kv_heads / o.cp, d.head_dim, cdt);
    L.attention_bytes = TiledAttention::buffer_bytes(o.attention_tile, S, d.heads / o.cp, d.kv_heads / o.cp,
                                                     d.head_dim, cdt, L.attention_sums_in_dln);
  }
  if (o.ring && layers)
    L.attention_bytes = RingAttention::buffer_bytes(o.max_batch, o.max_seq, d.heads, d.kv_heads,
                                                       d.head_dim, cdt);
  else if (o.cp > 1 && layers)
    L.attention_bytes += UlyssesExchange::buffer_bytes(o.max_batch, o.max_seq * o.cp,
                                                         d.heads / o.cp * d.head_dim, cdt);
  if (o.ep > 1) {
    const ExpertDispatcher::Footprint f = ExpertDispatcher::footprint(E, o.ep, R, o.moe_chunks);
    L.num_dispatchers = sets * (L.sets_per_pass ? o.passes_in_flight : 1);
    L.dispatch_device_bytes = size_t(L.num_dispatchers) * f.device_bytes;
    L.dispatch_host_bytes = size_t(L.num_dispatchers) * f.host_bytes;
  }
  L.passes = o.passes_in_flight;
  add_banks(L.device, L.device_bank, L.passes);
  add_banks(L.host, L.host_bank, L.passes);
  return L;
}

}  // namespace mop
