// The activations of one micro-batch, planned before anything is allocated: every buffer the
// model's forward and backward use (arena slots, in order, tagged with the component they serve),
// the host mirrors, and the buffers the sequence-parallel attention and the expert dispatchers
// allocate for themselves. The Transformer lays out its arena from this plan, slot for slot, so
// the memory the plan reports is the memory the model uses (plan/plan.h sums it per class).
//
// Layer l reads activation set sets[l] (one per layer), or with recompute the single shared set
// sets[0], refilled from the saved layer input xs[l] just before the layer's backward.
//
// Long sequences (recompute on): a layer's saved tensors — its input and, where the plan keeps
// it, its attention output and lse (then attention is not recomputed) — stay on the device or go
// to pinned host memory (the first host_layers layers), copied out as forward makes them and
// back one layer ahead in backward (model/saved_activations.h). The MoE block and the dense FFN
// run in token chunks of moe_chunk tokens: routed rows and expert intermediates are O(chunk), and
// the backward recomputes each chunk's experts before differentiating them.
#pragma once

#include <array>
#include <cstddef>
#include <vector>

#include "core/tensor.h"
#include "model/model_spec.h"

namespace mop {

// What a buffer serves (the plan's per-component memory).
enum class Component : uint8_t {
  Checkpoints,  // the layer inputs x_0..x_L (kept for backward; the recompute checkpoints)
  Attention,    // norms, q/k/v, attention output and lse, Ulysses/ring buffers
  Router,       // router logits, probabilities, top-k, route plan
  Experts,      // routed rows, expert intermediates, the dispatchers' buffers
  DenseFfn,     // dense FFN layers and the shared expert
  LmHead,       // final norm, per-token losses, the LM-head chunk
  Gradients,    // the activation gradients shared by every layer in backward
};
constexpr int kNumComponents = 7;
const char* component_name(Component c);

struct ActivationOptions {
  int max_batch = 1, max_seq = 1;  // max_seq: tokens per sequence on this rank (S / cp)
  int cp = 1, ep = 1;              // sequence and expert shards
  bool ring = false;               // cp > 1 through ring attention (else Ulysses)
  bool recompute = false;
  int64_t lm_head_chunk = 1024;
  int moe_chunks = 1;  // ep > 1: the expert dispatchers' chunks
  // ep > 1: the rows a rank's receive buffers hold (exchange_rows() of parallel.moe.
  // exchange_budget); a rank whose experts receive more takes them in rounds. 0: the worst case.
  int64_t exchange_rows = 0;
  // Tokens per chunk of the MoE block (router → dispatch → experts → combine) and the dense FFN;
  // 0, or at least the micro-batch's tokens: the whole micro-batch at once (nothing recomputed).
  int64_t moe_chunk = 0;
  // With recompute: layers [0, host_layers) keep their saved tensors in pinned host memory, the
  // others on the device; layers [0, keep_attention) keep their attention output and lse.
  int host_layers = 0, keep_attention = 0;
  // With recompute and attention in query tiles (cp 1, micro-batches of one sequence): the other
  // layers [keep_attention, L) keep the last keep_attention_tail query tiles of their attention
  // output and lse, and their recompute runs the tiles before them only. A tile late in the
  // sequence costs the most to recompute (tile i sees i + 1 key tiles), so keeping the last t of
  // n tiles saves 1 − (1 − t/n)² of a layer's recompute for t/n of its memory.
  int keep_attention_tail = 0;
  // Tokens per query tile of the causal attention over whole sequences (cp 1 or Ulysses; see
  // model/tiled_attention.h); 0, or at least the sequence: one call.
  int64_t attention_tile = 0;
  DType compute = DType::F32;
  // Pipeline stages: the segments [first_segment, end_segment) this rank's model runs (model/
  // params.h: 0 the embedding, 1..L the layers, L+1 the final norm and LM head; end_segment -1:
  // through the head). Layers outside get no activations; a stage that starts after the
  // embedding receives its input x_{first-1} (kept on the device, never in host memory), one that
  // ends before the head sends x_{end-1}.
  int first_segment = 0, end_segment = -1;
  // Passes (micro-batches) in flight at once: 1F1B runs the forward of micro-batch m+1 before the
  // backward of m, and stage i of p keeps up to p − i passes. What lives from a pass's forward to
  // its backward has one bank per pass: the layer inputs and every saved tensor (device and host),
  // without recompute the layers' activation sets (and their expert dispatchers), the final norm's
  // rstd and, with more than one pass, the LM head's input gradient (else in dln). Everything else
  // (gradient buffers, recompute's one set, scratch, attention buffers) is shared by the passes.
  int passes_in_flight = 1;

  // The chunk in use for T tokens (T when the block runs unchunked).
  int64_t chunk_tokens(int64_t T) const { return moe_chunk > 0 && moe_chunk < T ? moe_chunk : T; }
  bool chunked(int64_t T) const { return chunk_tokens(T) < T; }
};

// Arena slots of one layer's activations; -1 where the layer has no such buffer.
struct ActSlots {
  int ln1 = -1, rstd1 = -1, q_raw = -1, k_raw = -1, q = -1, k = -1, v = -1, q_rstd = -1,
      k_rstd = -1, attn = -1, lse = -1, x_mid = -1, ln2 = -1, rstd2 = -1;
  int logits = -1, probs = -1, rlse = -1, topk_idx = -1, topk_w = -1, counts = -1, offsets = -1;
  int perm_src = -1, slot_of = -1, aux_grad = -1, xp = -1, gu = -1, h = -1, yp = -1;
  int offsets_host = -1;  // host mirror slot: offsets (grouped GEMMs size their groups on the host)
  // Chunked MoE: one chunk's route plan (perm_src, slot_of above cover the whole micro-batch and
  // give the counts the load-balancing loss needs).
  int c_counts = -1, c_offsets = -1, c_perm_src = -1, c_slot_of = -1, c_offsets_host = -1;
  int q_full = -1, k_full = -1, v_full = -1, attn_full = -1;  // Ulysses: head-sharded, full sequences
  int xp_local = -1, yp_local = -1;  // ep > 1: rows of this rank's experts from every rank
  int shared_gu = -1, shared_h = -1;  // shared expert
  int ffn_gu = -1, ffn_h = -1;        // dense FFN layers
};

// Arena slots of the buffers shared by all layers: gradients flowing backward, the final norm and
// loss, and the scratch for recomputation.
struct SharedSlots {
  int dx = -1, dln = -1, dattn = -1, dq = -1, dk = -1, dv = -1, dq_raw = -1, dk_raw = -1;
  int dlogits = -1, dlogits_c = -1, dtopk_w = -1;
  int dyp = -1, dh = -1, dgu = -1, dxp = -1, dffn_h = -1, dffn_gu = -1;
  int xf = -1, rstd_f = -1, dxf = -1, loss_tok = -1, lse_tok = -1, lm_ws = -1, losses = -1;
  int loss_tmp = -1, scratch_out = -1, scratch_losses = -1;
  int dattn_full = -1, dq_full = -1, dk_full = -1, dv_full = -1;  // Ulysses
  int dyp_local = -1, dxp_local = -1, dispatch_scratch = -1, counts_global = -1;  // ep / cp > 1
};

struct BufferSpec {
  Tensor shape;  // dtype and dims (no data)
  Component component;
  bool per_pass = false;  // one copy per pass in flight (a bank), see passes_in_flight
  // A view: the bytes of slot `within` from `offset` on (buffers whose lifetimes never overlap);
  // it adds nothing to the arena. -1: a buffer of its own.
  int within = -1;
  size_t offset = 0;
};

struct ActivationLayout {
  std::vector<BufferSpec> device;  // the arena on the ops device, slot by slot
  std::vector<BufferSpec> host;    // the host mirrors (pinned next to a GPU)
  // Banks (passes_in_flight): every slot named below is bank 0's; bank b's copy of a per-pass
  // slot is device_slot(slot, b) (host_slot for the mirrors), appended after bank 0's slots, so
  // one pass in flight lays out exactly the single-pass arena. Shared slots are their own copy.
  int passes = 1;
  std::vector<std::vector<int>> device_bank, host_bank;  // [bank][bank 0's slot]
  int device_slot(int slot, int bank) const {
    return slot < 0 ? slot : device_bank[size_t(bank)][size_t(slot)];
  }
  int host_slot(int slot, int bank) const {
    return slot < 0 ? slot : host_bank[size_t(bank)][size_t(slot)];
  }
  // The stage: segments [first_segment, end_segment), its layers [first_layer, end_layer).
  int first_segment = 0, end_segment = 0, first_layer = 0, end_layer = 0;
  std::vector<int> xs;             // layer inputs x_0..x_L (x_L feeds the final norm; with every
                                   // layer's input on the host it shares x_{L-2}'s stage); -1
                                   // where the stage does not read or write it
  // Layer l's set: sets[l - first_layer] (one per layer of the stage), or with recompute sets[0].
  std::vector<ActSlots> sets;
  // Saved tensors per layer (recompute): the host slot of the input (-1: on the device; then
  // xs[l] is its own slot, else one of the two stages it passes through); the kept attention
  // output [T,Q] and lse [T·Nq] on the device (attn_saved) or in host memory (attn_host), -1
  // where the layer recomputes its attention.
  std::vector<int> xs_host, attn_saved, lse_saved, attn_host, lse_host;
  // The kept tails of the other layers (keep_attention_tail): the last tail_rows rows of the
  // attention output [tail_rows,Q] and lse [tail_rows·Nq] (tile-major: the tail tiles' blocks),
  // on the device (tail_saved) or in host memory (tail_host); -1 where a layer keeps none.
  std::vector<int> tail_saved, tail_lse_saved, tail_host, tail_lse_host;
  int64_t tail_rows = 0;
  // With recompute, the q/k projections before their norms are transient: forward writes them
  // into the (then unused) gradient buffers dattn and dk_raw, and the backward projects them
  // again into q and k (free once attention's backward has run) for the norms' backward.
  bool qk_raw_recomputed = false;
  SharedSlots shared;
  // Allocated by their owners next to the arena: the Ulysses exchange or ring attention and the
  // tiled attention's buffers (device), and the expert dispatchers (one per activation set and
  // bank of sets; device index maps, host offsets).
  size_t attention_bytes = 0, dispatch_device_bytes = 0, dispatch_host_bytes = 0;
  bool sets_per_pass = false;  // without recompute: each pass has its own sets (and dispatchers)
  int num_dispatchers = 0;     // ep > 1: sets × (sets_per_pass ? passes : 1)
  // Attention in query tiles: its dK/dV sums live in dln (dead during attention's backward)
  // where dln holds them, else in the tiled attention's own buffer.
  bool attention_sums_in_dln = false;

  size_t arena_bytes() const;       // the device arena, with its slot alignment
  size_t host_arena_bytes() const;  // the host mirrors' arena
  // Everything above on the ops device (arena, attention and dispatch buffers), per component.
  std::array<size_t, kNumComponents> device_by_component() const;
  size_t device_bytes() const;
  size_t host_bytes() const { return host_arena_bytes() + dispatch_host_bytes; }
};

ActivationLayout plan_activations(const ModelDims& dims, const ActivationOptions& options);

// The expert exchange's receive buffers for parallel.moe.exchange_budget: max(1, ⌈budget ·
// rows_per_rank⌉) rows, rows_per_rank = a rank's routed rows (T_local · top_k, T_local the
// micro-batch's or the MoE chunk's tokens); 0 (the worst case) for a budget of 0, for ep 1 and
// wherever the budget reaches the worst case ep · rows_per_rank.
int64_t exchange_rows(double budget, int64_t rows_per_rank, int ep);
// The rows a rank's receive buffers hold (x_local, gu, h, the dispatcher's maps, …): the dropless
// worst case ep · rows_per_rank, or options.exchange_rows where that is smaller. The plan and the
// model both size them with this.
int64_t receive_rows(const ActivationOptions& options, int64_t rows_per_rank);

}  // namespace mop
