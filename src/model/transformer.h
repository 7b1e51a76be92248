// The MoE transformer's forward and backward for one micro-batch, segment by segment (a range of
// segments a call: the step program decides what runs between them), written once against the
// Ops interface. Layer l reads activations set acts(l): one set per layer, or with recompute a single
// shared set that is refilled from the saved layer input just before the layer's backward.
// All buffers come from one arena laid out by the activation plan (model/activations.h) in the
// constructor: no allocation per step, and the plan's memory is the model's. For long sequences
// the plan runs the MoE block and the dense FFN in token chunks (recomputed chunk by chunk in
// backward), keeps attention outputs so that backward does not recompute them, and puts saved
// tensors in host memory (model/saved_activations.h) — all with the plain step's results.
// Pipeline parallelism: the model may run a stage, a range of segments whose input comes from the
// stage before and whose output gradient from the stage after, and keep several passes in flight
// (1F1B), each in a bank of the activations that live from its forward to its backward.
#pragma once

#include <string>
#include <vector>

#include "model/activations.h"
#include "model/params.h"
#include "ops/ops.h"
#include "model/saved_activations.h"
#include "parallel/expert_dispatch.h"
#include "model/tiled_attention.h"
#include "parallel/ring_attention.h"
#include "parallel/sequence_parallel.h"
#include "runtime/memory.h"

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

// The comms a sharded model needs (not owned; null where the component is not sharded).
struct ModelComms {
  Comm* cp = nullptr;       // the sequence group: Ulysses exchanges, ring K/V, router counts
  Comm* cp_ring = nullptr;  // ring attention's asynchronous comm (GPU ranks), else cp serves
  Comm* ep = nullptr;       // the expert group: rows (tensors on the ops device)
  Comm* ep_host = nullptr;  // the expert group: counts (host)
  Comm* ep_dispatch = nullptr, *ep_combine = nullptr;  // the exchange's asynchronous comms, or null
};

struct TransformerOptions {
  // The activation plan's options: micro-batch size, this rank's tokens per sequence, the cp and
  // ep shards (cp > 1 shards sequences through Ulysses or ring attention, ep > 1 experts: the
  // layout must hold this rank's experts), recompute, the LM-head chunk, the exchange's chunks,
  // the stage (plan.first_segment, plan.end_segment) and the passes in flight
  // (plan.passes_in_flight).
  ActivationOptions plan;
  ModelComms comms;  // cp > 1: comms.cp; ep > 1: comms.ep and comms.ep_host
};

class Transformer {
 public:
  Transformer(const ModelLayout& layout, ParamStore& params, Ops& ops, TransformerOptions options);
  ~Transformer();

  // The activation plan; its device_bytes() are what allocate() takes on the ops device: the
  // arena and the buffers of the sequence-parallel attention and the expert dispatchers.
  const ActivationLayout& activations() const { return plan_; }
  size_t planned_bytes() const { return plan_.device_bytes(); }
  // Allocates the activations and lets the backend build its plans and workspaces for them.
  void allocate();

  // One micro-batch's pass: what its segments' forward and backward share. Its activations live
  // in bank `bank` of the model's slots (plan.passes_in_flight banks; activations.h says what a
  // bank holds and what the passes share). With one bank a begin() ends the last pass. With more,
  // a training pass holds its bank until its backward has run the stage's first segment, and
  // begin() on a bank still held is an internal error; so is a bank beyond passes_in_flight. A
  // pass's backward, once begun, runs to the stage's first segment before another pass's forward
  // or backward (they share the gradient buffers and recompute's one set): 1F1B's order.
  struct Pass {
    Batch batch;
    int64_t tokens = 0;  // B·S
    float aux_scale = 1, ce_scale = 0;
    bool training = false, write_experts = false;
    int bank = 0;
  };
  // Starts a pass over micro-batch b. Each unmasked token's CE is weighted by ce_scale in the loss
  // (1 / unmasked tokens of the whole optimizer step); the router losses by aux_scale (1 /
  // micro-batches). training: a backward follows (the head's gradients come with its forward).
  // write_experts: the routed experts' weight gradients (most of an MoE's parameters) are
  // written, not added to — the first micro-batch of a step, whose caller then zeroes only the
  // other gradients; the values are those of adding to zeros.
  // bank: where the pass's activations live, [0, passes_in_flight) (1F1B: micro-batch m % the
  // stage's passes in flight). A stage after the first reads the batch's positions (and the last
  // stage its targets), never its ids.
  Pass begin(const Batch& b, float aux_scale, bool training, float ce_scale = 0,
             bool write_experts = false, int bank = 0);
  // Segments [begin, end) of the pass (model/params.h: 0 embedding, 1..L layers, L+1 final norm
  // and LM head): forward in order; backward in reverse order, after the forward of every
  // segment. Parameter gradients accumulate (+=) into the store; loss terms accumulate on the
  // device (take_losses()). Whatever waits for weights or hands gradients on between segments is
  // the step program's (plan/program.h), run by the schedule.
  // Only the stage's segments run.
  void forward(const Pass& p, int begin, int end);
  void backward(const Pass& p, int begin, int end);

  // The stage: segments [first_segment(), end_segment()) (plan.first_segment, plan.end_segment).
  int first_segment() const { return plan_.first_segment; }
  int end_segment() const { return plan_.end_segment; }
  // Stage boundaries, each [B·S, H] in the compute dtype (the pass's tokens). A stage that starts
  // after the embedding: the received hidden state x_{first-1} is written into stage_input(p)
  // before forward(p, first, …) (the pass's bank). A stage that ends before the head: after the
  // forward of its last segment stage_output(p) holds x_{end-1}, to send (the pass's bank: valid
  // until the bank's next pass writes it). Backward: the received gradient w.r.t. that output is
  // written into stage_output_grad(p) before backward(p, …, end); after the backward of the first
  // segment stage_input_grad(p) holds the gradient w.r.t. the stage's input, to send. Both
  // gradients are the one residual-gradient buffer the passes share: write the received one
  // after the last pass's backward on this stage, send the other before the next pass's backward.
  Tensor stage_input(const Pass& p) const;
  Tensor stage_output(const Pass& p) const;
  Tensor stage_output_grad(const Pass& p) const;
  Tensor stage_input_grad(const Pass& p) const;

  // The whole pass at once (a model of every segment): forward and backward over every segment,
  // or the forward alone.
  void forward_backward(const Batch& b, float ce_scale, float aux_scale, bool write_experts = false);
  void forward(const Batch& b, float aux_scale);
  // Whether a pass with write_experts writes parameter p's gradient (a routed expert tensor): its
  // caller need not zero it.
  bool writes_gradient(int p) const { return layout_.params[size_t(p)].kind == ParamKind::Experts; }
  // Returns the sums since the last call and resets them: of the terms this stage computes (CE
  // on the stage with the head, aux and z on the stages with MoE layers); a pipeline sums them
  // over the stages.
  LossTerms take_losses();

  // After forward(): logits of token `row` (acc dtype [V]) from the final hidden state.
  void logits(Tensor out, int row);

  // The rows this rank's tokens routed to each global expert of each MoE layer, [moe layer][E]
  // (row-major), and the tokens they came from (per layer), summed over the training passes since
  // construction: a pass's forward counts once — neither a recomputing layer's forward nor a pass
  // without training (evaluation, score, generate) counts. From the group sizes the forward
  // brings to the host anyway (the router's offsets), so counting costs E additions per MoE layer.
  // A stage counts its own layers; routed_tokens() is counted at the model's first MoE layer, by
  // the stage that runs it (so a pipeline's sum over its ranks counts each token once).
  const std::vector<int64_t>& routed_counts() const { return routed_counts_; }
  int64_t routed_tokens() const { return routed_tokens_; }

 private:
  using Acts = ActSlots;
  using Shared = SharedSlots;
  Tensor W(int p) const { return params_.weight(p); }
  Tensor G(int p) const { return params_.grad(p); }
  // Slots of the plan (bank 0's numbers) in the running pass's bank.
  Tensor dev(int slot) const { return arena_.tensor(plan_.device_slot(slot, bank_)); }
  Tensor mirror(int slot) const { return host_arena_.tensor(plan_.host_slot(slot, bank_)); }
  Tensor act(int slot, int64_t rows) const;  // the first `rows` rows of a slot
  Tensor scratch(int slot, std::initializer_list<int64_t> dims) const;  // leading elements, reshaped
  void layer_fwd(int l, const Acts& a, const Batch& b, Tensor x_in, Tensor x_out, Tensor losses,
                 float aux_scale, bool recompute);
  void layer_bwd(int l, const Acts& a, const Batch& b, Tensor x_in, Tensor dx, float aux_scale);
  // count: add the layer's routed rows to routed_counts_ (a training pass's own forward).
  void moe_fwd(int l, const Acts& a, int64_t T, Tensor x_out, Tensor losses, float aux_scale,
               bool experts, bool count);
  void count_routed(int l, const Tensor& offsets_host);  // host I32 [E+1] group offsets
  void routed_fwd(int l, const LayerParams& P, const Acts& a, const Tensor& offsets_host, Tensor xp, Tensor yp);
  // write: the experts' weight gradients are written (forward_backward's write_experts).
  void routed_bwd(const LayerParams& P, const Acts& a, const Tensor& offsets_host, const Tensor& xp,
                  const Tensor& dyp, Tensor dxp, bool write);
  Tensor chunk_experts_fwd(int l, const LayerParams& P, const Acts& a, int64_t T, int64_t t0, int64_t n);
  // A layer's attention output [T,Q] and lse [T·Nq]: its kept ones on the device, else the set's.
  Tensor attn_of(int l, const Acts& a, int64_t T) const;
  Tensor lse_of(int l, const Acts& a, int64_t T) const;
  void experts_fwd(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                   const Tensor& x, Tensor y);
  void experts_gate_up(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                       const Tensor& x);
  void experts_bwd(const LayerParams& P, const Acts& a, const ExpertDispatcher::Chunk& k,
                   const Tensor& x, const Tensor& dy, Tensor dx, bool write);
  void moe_bwd(int l, const Acts& a, int64_t T, Tensor dx, Tensor dln, float aux_scale);
  void ffn_fwd(int gate_up, int down, int gu_slot, int h_slot, Tensor x, Tensor x_out, int64_t T);
  void ffn_bwd(int gate_up, int down, int gu_slot, int h_slot, Tensor x, Tensor dy, Tensor dx,
               int64_t T);
  void forward_segment(const Pass& p, int s);
  void backward_segment(const Pass& p, int s);
  void use(const Pass& p);  // the pass's bank and flags for the segments that follow
  const Acts& acts(int l) const;
  ExpertDispatcher& dispatcher(const Acts& a);  // the set's, in the running pass's bank
  Tensor in_bank(int slot, const Pass& p) const;  // [tokens, …] of a slot in p's bank

  const ModelLayout& layout_;
  const ModelDims& d_;
  ParamStore& params_;
  Ops& ops_;
  TransformerOptions opt_;
  ActivationLayout plan_;
  DType cdt_, adt_;  // compute and acc dtypes
  Arena arena_;       // on the ops device
  Arena host_arena_;  // host mirrors (pinned when the device is a GPU)
  const std::vector<Acts>& acts_;
  const std::vector<int>& xs_;  // layer inputs x_0..x_L (x_L feeds the final norm)
  const Shared& s_;
  int last_T_ = 0;
  int cp_ = 1, ep_ = 1;
  bool ring_ = false;  // cp > 1 through ring attention (else Ulysses)
  std::unique_ptr<UlyssesExchange> ulysses_;
  std::unique_ptr<RingAttention> ring_attention_;
  std::unique_ptr<TiledAttention> tiled_;  // cp 1 and Ulysses: whole sequences, maybe in tiles
  std::vector<std::unique_ptr<ExpertDispatcher>> dispatch_;  // per activation set (ep > 1)
  void attention_fwd(const Acts& a, const Batch& b, int64_t T, Tensor attn, Tensor lse);
  void attention_bwd(const Acts& a, const Batch& b, int64_t T, const Tensor& attn, const Tensor& lse);
  std::unique_ptr<SavedActivations> saved_;  // with recompute
  int bank_ = 0;                             // the running pass's bank
  bool training_ = false;                    // the pass running is followed by a backward
  bool write_experts_ = false;               // the pass's write_experts, for moe_bwd
  std::vector<char> held_;                   // [bank]: a training pass whose backward is to come
  int open_backward_ = -1;                   // the bank whose backward has begun, not ended
  std::vector<int64_t> routed_counts_;       // [moe layer][E], see routed_counts()
  int64_t routed_tokens_ = 0;
};

}  // namespace mop
