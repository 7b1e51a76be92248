// The activation plan (see activations.h): the buffers of one micro-batch, T = batch · local
// sequence tokens, in the order the Transformer adds them to its arena.
#include "plan/activations.h"

#include <algorithm>

#include "core/memory.h"
#include "parallel/expert_dispatch.h"
#include "parallel/ring_attention.h"
#include "parallel/sequence_parallel.h"

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
  for (const BufferSpec& b : device) n += align_up(b.shape.bytes());
  return n;
}

size_t ActivationLayout::host_arena_bytes() const {
  size_t n = 0;
  for (const BufferSpec& b : host) n += align_up(b.shape.bytes());
  return n;
}

std::array<size_t, kNumComponents> ActivationLayout::device_by_component() const {
  std::array<size_t, kNumComponents> out{};
  for (const BufferSpec& b : device) out[size_t(b.component)] += align_up(b.shape.bytes());
  out[size_t(Component::Attention)] += cp_attention_bytes;
  out[size_t(Component::Experts)] += dispatch_device_bytes;
  return out;
}

size_t ActivationLayout::device_bytes() const {
  return arena_bytes() + cp_attention_bytes + dispatch_device_bytes;
}

ActivationLayout plan_activations(const ModelDims& d, const ActivationOptions& o) {
  ActivationLayout L;
  const int64_t T = int64_t(o.max_batch) * o.max_seq, H = d.hidden;
  const int64_t Q = d.q_width(), KV = d.kv_width(), E = d.experts, K = d.top_k;
  const int64_t TK = T * K;
  const DType cdt = o.compute, adt = acc_dtype(o.compute);
  // Dropless expert parallelism: a rank may receive every row of its ep group (ep·T·K).
  const int64_t R = TK * o.ep;
  Component comp = Component::Checkpoints;
  auto add = [&](DType dt, std::initializer_list<int64_t> dims) {
    L.device.push_back({Tensor(nullptr, dt, dims), comp});
    return int(L.device.size()) - 1;
  };
  auto c = [&](std::initializer_list<int64_t> dims) { return add(cdt, dims); };
  auto a = [&](std::initializer_list<int64_t> dims) { return add(adt, dims); };
  auto i = [&](std::initializer_list<int64_t> dims) { return add(DType::I32, dims); };

  for (int l = 0; l <= d.layers; ++l) L.xs.push_back(c({T, H}));
  const int sets = o.recompute ? 1 : int(d.layers);
  const bool any_moe = d.num_moe_layers() > 0, any_dense = d.first_dense > 0;
  for (int set = 0; set < sets; ++set) {
    ActSlots s;
    comp = Component::Attention;
    s.ln1 = c({T, H}), s.rstd1 = a({T});
    s.q_raw = c({T, Q}), s.k_raw = c({T, KV}), s.q = c({T, Q}), s.k = c({T, KV}), s.v = c({T, KV});
    s.q_rstd = a({T * d.heads}), s.k_rstd = a({T * d.kv_heads});
    s.attn = c({T, Q}), s.lse = a({T * d.heads});
    // Ulysses: whole sequences, heads/cp of them. Ring attention keeps the local layout; its lse is
    // [2·batch, Nq, c] blocks, the same T·Nq elements.
    if (o.cp > 1 && !o.ring)
      s.q_full = c({T, Q}), s.k_full = c({T, KV}), s.v_full = c({T, KV}), s.attn_full = c({T, Q});
    s.x_mid = c({T, H}), s.ln2 = c({T, H}), s.rstd2 = a({T});
    // With recompute the single set serves every layer, so it needs both MoE and dense buffers;
    // without, layer `set` needs only its own kind.
    const bool moe = o.recompute ? any_moe : d.is_moe(set);
    const bool dense = o.recompute ? any_dense : !d.is_moe(set);
    if (moe) {
      comp = Component::Router;
      s.logits = a({T, E}), s.probs = a({T, E}), s.rlse = a({T});
      s.topk_idx = i({T, K}), s.topk_w = a({T, K});
      s.counts = i({E}), s.offsets = i({E + 1}), s.perm_src = i({TK}), s.slot_of = i({TK});
      s.aux_grad = a({E});
      L.host.push_back({Tensor(nullptr, DType::I32, {E + 1}), comp});
      s.offsets_host = int(L.host.size()) - 1;
      comp = Component::Experts;
      s.xp = c({TK, H}), s.gu = c({R, 2 * d.expert_ffn}), s.h = c({R, d.expert_ffn});
      s.yp = c({TK, H});
      if (o.ep > 1) s.xp_local = c({R, H}), s.yp_local = c({R, H});
      comp = Component::DenseFfn;
      if (d.shared_ffn) s.shared_gu = c({T, 2 * d.shared_ffn}), s.shared_h = c({T, d.shared_ffn});
    }
    comp = Component::DenseFfn;
    if (dense) s.ffn_gu = c({T, 2 * d.dense_ffn}), s.ffn_h = c({T, d.dense_ffn});
    L.sets.push_back(s);
  }
  SharedSlots& s = L.shared;
  comp = Component::Gradients;
  s.dx = c({T, H}), s.dln = c({T, H}), s.dattn = c({T, Q});
  s.dq = c({T, Q}), s.dk = c({T, KV}), s.dv = c({T, KV});
  s.dq_raw = c({T, Q}), s.dk_raw = c({T, KV});
  if (any_moe) {
    s.dlogits = a({T, E}), s.dlogits_c = c({T, E}), s.dtopk_w = a({T, K});
    s.dyp = c({TK, H}), s.dh = c({R, d.expert_ffn}), s.dgu = c({R, 2 * d.expert_ffn});
    s.dxp = c({TK, H});
    if (o.ep > 1) s.dyp_local = c({R, H}), s.dxp_local = c({R, H}), s.dispatch_scratch = c({R, H});
    if (o.cp > 1) s.counts_global = i({E});
  }
  if (o.cp > 1 && !o.ring) {
    s.dattn_full = c({T, Q}), s.dq_full = c({T, Q}), s.dk_full = c({T, KV}), s.dv_full = c({T, KV});
  }
  // Dense-layer and shared-expert FFN gradients share one pair of buffers of the wider width.
  const int64_t ffn_w = std::max(any_dense ? d.dense_ffn : 0, any_moe ? d.shared_ffn : 0);
  if (ffn_w) s.dffn_h = c({T, ffn_w}), s.dffn_gu = c({T, 2 * ffn_w});
  comp = Component::LmHead;
  s.xf = c({T, H}), s.rstd_f = a({T}), s.dxf = c({T, H});
  s.loss_tok = a({T}), s.lse_tok = a({T});
  s.lm_ws = a({std::min<int64_t>(o.lm_head_chunk, T), d.vocab});
  s.losses = a({3}), s.loss_tmp = a({1});
  comp = Component::Checkpoints;
  s.scratch_out = o.recompute ? c({T, H}) : -1;
  comp = Component::LmHead;
  s.scratch_losses = a({2});

  if (o.ring)
    L.cp_attention_bytes = RingAttention::buffer_bytes(o.max_batch, o.max_seq, d.heads, d.kv_heads,
                                                       d.head_dim, cdt);
  else if (o.cp > 1)
    L.cp_attention_bytes = UlyssesExchange::buffer_bytes(o.max_batch, o.max_seq * o.cp,
                                                         d.heads / o.cp * d.head_dim, cdt);
  if (o.ep > 1) {
    const int64_t max_rows_in = R;
    const ExpertDispatcher::Footprint f = ExpertDispatcher::footprint(E, o.ep, max_rows_in, o.moe_chunks);
    L.dispatch_device_bytes = size_t(sets) * f.device_bytes;
    L.dispatch_host_bytes = size_t(sets) * f.host_bytes;
  }
  return L;
}

}  // namespace mop
