// The MoE transformer's forward and backward for one micro-batch, written once against the Ops
// interface. Layer l reads activations set acts(l): one set per layer, or with recompute a single
// shared set that is refilled from the saved layer input just before the layer's backward.
// All buffers come from one arena planned in the constructor (no allocation per step).
#pragma once

#include <functional>
#include <string>
#include <vector>

#include "core/memory.h"
#include "model/params.h"
#include "model/ring_attention.h"
#include "model/sequence_parallel.h"
#include "ops/ops.h"
#include "parallel/expert_dispatch.h"
#include "parallel/groups.h"

namespace mop {

// One micro-batch on this rank: B sequences of S tokens each (with sequence parallelism, this
// rank's S = S_full/cp tokens of every sequence, see sequence_parallel.h), I32 tensors of B·S on
// the ops device.
struct Batch {
  int batch = 0, seq = 0;
  Tensor ids, targets /* -1: masked */, positions;
};

struct LossTerms {
  double ce_sum = 0;  // Σ cross-entropy over unmasked tokens
  double aux = 0;     // load-balancing loss, already weighted (coef, 1/MoE layers, aux_scale)
  double z = 0;       // router z-loss, weighted likewise
};

// Called at the stages of a micro-batch (0 embedding, 1..L layers, L+1 final norm and LM head):
// before a stage's weights are first read in forward, and once its weight gradients are written
// in backward. The host optimizer uses them to pipeline updates and transfers.
struct StageHooks {
  std::function<void(int stage)> before_forward;
  std::function<void(int stage)> after_backward;
  std::function<void(bool backward)> phase;  // at the start of the forward and of the backward
};

struct TransformerOptions {
  int max_batch = 1, max_seq = 1;  // max_seq: tokens per sequence on this rank
  bool recompute = false;
  int64_t lm_head_chunk = 1024;
  // Parallel groups (not owned); null: one rank. cp > 1 shards sequences (Ulysses or ring
  // attention), ep > 1 shards experts (the layout must hold this rank's experts).
  ParallelGroups* groups = nullptr;
  // parallel.attention.impl: auto | ulysses | ring (cp > 1; see use_ring_attention).
  std::string attention_impl = "auto";
  // parallel.moe.chunks: ep > 1, the chunks the expert exchange is overlapped in (expert_dispatch.h).
  int moe_chunks = 1;
};

class Transformer {
 public:
  Transformer(const ModelLayout& layout, ParamStore& params, Ops& ops, TransformerOptions options);
  ~Transformer();

  // Planned activation memory on the ops device (bytes), available before allocate(): the arena
  // and the buffers of the sequence-parallel attention (Ulysses exchange or ring attention).
  size_t planned_bytes() const { return arena_.planned_bytes() + cp_attention_bytes_; }
  // Allocates the activations and lets the backend build its plans and workspaces for them.
  void allocate();

  // Forward and backward of one micro-batch; parameter gradients accumulate (+=) into the store.
  // Each unmasked token's CE is weighted by ce_scale in the loss (1 / unmasked tokens of the whole
  // optimizer step); the router losses of this micro-batch by aux_scale (1 / micro-batches).
  // Loss terms accumulate on the device; read them with take_losses().
  void forward_backward(const Batch& b, float ce_scale, float aux_scale);
  void forward(const Batch& b, float aux_scale);
  LossTerms take_losses();  // returns the sums since the last call and resets them

  // After forward(): logits of token `row` (acc dtype [V]) from the final hidden state.
  void logits(Tensor out, int row);

  void set_hooks(StageHooks hooks) { hooks_ = std::move(hooks); }

 private:
  // Arena slots (indices) of one layer's activations; -1 where the layer has no such buffer.
  struct Acts {
    int ln1, rstd1, q_raw, k_raw, q, k, v, q_rstd, k_rstd, attn, lse, x_mid, ln2, rstd2;
    int logits = -1, probs = -1, rlse = -1, topk_idx = -1, topk_w = -1, counts = -1, offsets = -1;
    int perm_src = -1, slot_of = -1, aux_grad = -1, xp = -1, gu = -1, h = -1, yp = -1;
    int offsets_host = -1;  // host copy of offsets (grouped GEMMs size their groups on the host)
    int q_full = -1, k_full = -1, v_full = -1, attn_full = -1;  // Ulysses: head-sharded, full sequences
    int xp_local = -1, yp_local = -1;  // ep > 1: rows of this rank's experts from every rank
    int shared_gu = -1, shared_h = -1;  // shared expert
    int ffn_gu = -1, ffn_h = -1;        // dense FFN layers
  };
  // Arena slots of the buffers shared by all layers: gradients flowing backward, the final
  // norm and loss, and the scratch for recomputation.
  struct Shared {
    int dx, dln, dattn, dq, dk, dv, dq_raw, dk_raw, dlogits = -1, dlogits_c = -1, dtopk_w = -1;
    int dyp = -1, dh = -1, dgu = -1, dxp = -1, dffn_h = -1, dffn_gu = -1;
    int xf, rstd_f, dxf, loss_tok, lse_tok, lm_ws, losses, loss_tmp, scratch_out, scratch_losses;
    int dattn_full = -1, dq_full = -1, dk_full = -1, dv_full = -1;  // Ulysses
    int dyp_local = -1, dxp_local = -1, dispatch_scratch = -1, counts_global = -1;  // ep / cp > 1
  };
  Tensor W(int p) const { return params_.weight(p); }
  Tensor G(int p) const { return params_.grad(p); }
  Tensor act(int slot, int64_t rows) const;  // the first `rows` rows of a slot
  Tensor scratch(int slot, std::initializer_list<int64_t> dims) const;  // leading elements, reshaped
  void layer_fwd(int l, const Acts& a, const Batch& b, Tensor x_in, Tensor x_out, Tensor losses,
                 float aux_scale);
  void layer_bwd(int l, const Acts& a, const Batch& b, Tensor x_in, Tensor dx, float aux_scale);
  void moe_fwd(int l, const Acts& a, int64_t T, Tensor x_out, Tensor losses, float aux_scale);
  void experts_fwd(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                   const Tensor& x, Tensor y);
  void experts_bwd(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                   const Tensor& x, const Tensor& dy, Tensor dx);
  void moe_bwd(int l, const Acts& a, int64_t T, Tensor dx, Tensor dln, float aux_scale);
  void ffn_fwd(int gate_up, int down, int gu_slot, int h_slot, Tensor x, Tensor x_out, int64_t T);
  void ffn_bwd(int gate_up, int down, int gu_slot, int h_slot, Tensor x, Tensor dy, Tensor dx,
               int64_t T);
  void run_forward(const Batch& b, float aux_scale);
  const Acts& acts(int l) const;

  const ModelLayout& layout_;
  const ModelDims& d_;
  ParamStore& params_;
  Ops& ops_;
  TransformerOptions opt_;
  DType cdt_, adt_;  // compute and acc dtypes
  Arena arena_;       // on the ops device
  Arena host_arena_;  // host mirrors (pinned when the device is a GPU)
  std::vector<Acts> acts_;
  std::vector<int> xs_;  // layer inputs x_0..x_L (x_L feeds the final norm)
  Shared s_{};
  int last_T_ = 0;
  int cp_ = 1, ep_ = 1;
  bool ring_ = false;              // cp > 1 through ring attention (else Ulysses)
  size_t cp_attention_bytes_ = 0;  // what the one below allocates
  std::unique_ptr<UlyssesExchange> ulysses_;
  std::unique_ptr<RingAttention> ring_attention_;
  std::vector<std::unique_ptr<ExpertDispatcher>> dispatch_;  // per activation set (ep > 1)
  void attention_fwd(const Acts& a, const Batch& b, int64_t T);
  void attention_bwd(const Acts& a, const Batch& b, int64_t T);
  StageHooks hooks_;
  void before_forward(int stage) {
    if (hooks_.before_forward) hooks_.before_forward(stage);
  }
  void after_backward(int stage) {
    if (hooks_.after_backward) hooks_.after_backward(stage);
  }
  void phase(bool backward) {
    if (hooks_.phase) hooks_.phase(backward);
  }
};

}  // namespace mop
