// The plan: a pure function from (config, machine, world size) to where and how every component
// of the step runs — the foldings (attention cp × dp with Ulysses or ring, experts ep × dp with
// the exchange's chunks), the backend and dtypes, recompute and micro-batching, which parameter
// groups keep their optimizer state on the device or in pinned host memory, the ZeRO owners —
// and what that costs: memory per rank (device and host, per tensor class, one estimator that
// `mop plan`, `mop validate` and the trainer share) and time per step (plan/time_model.h).
// The trainer builds from the plan and checks that what it allocates is what the plan says.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/activations.h"
#include "model/model_spec.h"
#include "plan/machine.h"
#include "plan/parallel_spec.h"
#include "plan/pipeline.h"
#include "plan/time_model.h"

namespace mop {

// How the step runs: backend device and dtypes.
struct RunPlacement {
  Device device = Device::CPU;
  DType compute = DType::F32;
  DType grad = DType::F32;
  std::string describe() const;
};
// train.device / train.precision for a machine whose device is `available` (auto picks it).
RunPlacement resolve_placement(const Config& cfg, Device available);

// parallel.attention.impl resolved for cp ranks: true for ring attention, false for Ulysses
// ("auto": Ulysses when both head counts divide by cp; "ulysses" when they do not is a UserError).
bool use_ring_attention(const std::string& impl, int64_t num_heads, int64_t num_kv_heads, int cp);

// Memory of one rank by tensor class (bytes).
struct MemoryPlan {
  // On the ops device (the GPU; on CPU runs host memory like the rest). With sliced parameters
  // `weights` includes the gathered weights of the two segments in flight; with sliced or
  // streamed gradients `grads` includes the two in-flight segments' whole gradients.
  size_t weights = 0, grads = 0;
  size_t optimizer_state = 0;    // fp32 master, m, v kept with the backend, and the norm slots
  size_t host_grad_staging = 0;  // device side of the host-updated parameters' gradient copies
  size_t activations = 0;        // ActivationLayout::device_bytes()
  std::array<size_t, kNumComponents> activations_by_component{};
  size_t workspaces = 0;  // the backend's (GEMM, attention, MoE and pointwise workspaces)
  size_t batch = 0;       // one micro-batch's ids, targets and positions
  size_t comms = 0;       // buffers of the asynchronous device communicators (estimate)
  // In host memory (pinned next to a GPU).
  size_t host_optimizer_state = 0;  // master, m, v of the host-updated parameters
  size_t host_staging = 0;          // the host pipeline's gradient and weight staging
  size_t host_activations = 0;      // host mirrors and the dispatchers' host buffers

  size_t device_total() const;
  size_t host_total() const;
};

struct Plan {
  Config cfg;  // the configuration the plan is for, every choice it made written in
  Machine machine;
  int world = 1;
  RunPlacement run;
  ModelDims dims;  // the whole model (experts_local = experts)

  // Foldings of a pipeline stage's ranks: attention cp × dp, experts ep × edp.
  int cp = 1, dp = 1, ep = 1, edp = 1;
  // Pipeline stages (parallel.pp): pp ranks along the pipeline, each running pp_chunks model chunks
  // (virtual stages; rank r's chunk c is virtual stage c · pp + r) in pp_schedule's order; `split`
  // gives the virtual stages' segments (one stage of every segment without a pipeline).
  int pp = 1, pp_chunks = 1;
  std::string pp_schedule = "1f1b";
  StageSplit split;
  // Pipeline stages: per pipeline rank, its chunks' activation plans (the model's: each chunk's
  // segments with a bank per pass of it the schedule keeps in flight), once per plan.
  std::vector<std::vector<ActivationLayout>> stage_activations;
  int stage_size() const { return world / pp; }
  int stage_of(int rank) const { return rank / stage_size(); }  // pp is the outermost axis
  // Whether `rank` runs segment s (every segment without a pipeline).
  bool runs_segment(int rank, int s) const;
  // Per segment whether `rank` runs it, for its parameter store (empty without a pipeline: all).
  std::vector<bool> held_segments(int rank) const;
  bool ring = false;  // cp > 1: ring attention (else Ulysses)
  int moe_chunks = 1;
  int local_seq = 0;       // tokens of each sequence on a rank (S / cp)
  int micro_batches = 1;   // per optimizer step on a rank
  // Optimizer state: per segment (model/params.h) in host memory or not, per parameter the same
  // (empty: none on the host).
  std::vector<bool> segment_on_host, state_on_host;
  // The mesh and each parameter's replicas and sharding (ZeRO-1 owners), per parameter of a
  // rank's layout.
  ParallelSpec parallel;
  int64_t host_params = 0;  // parameters whose state is in host memory (all ranks' owners)

  // The issue-27 techniques as planned: sliced parameters (parallel.shard: slice, in `parallel`),
  // host-updated segments' gradients streamed to the host (optim.gradients host, or auto's
  // choice), and the bounded expert exchange: exchange_rows rows received per MoE chunk (0: the
  // worst case), taken in exchange_rounds rounds under the plan's routing allowance.
  bool stream_grads = false;
  int64_t exchange_rows = 0;
  int exchange_rounds = 1;

  ActivationOptions activation_options;  // what the model's arena is laid out for
  ActivationLayout activations;
  MemoryPlan memory;  // of the rank that needs the most device memory
  int memory_rank = 0;
  StepTime time;
  // Why a setting was chosen, in order (placement, foldings, state); printed by `mop plan`.
  std::vector<std::string> notes;

  // A rank's layout (its experts; every ep rank's has the same shapes), built once per plan.
  const ModelLayout& local_layout() const;
  mutable std::shared_ptr<const ModelLayout> local_layout_cache;

  // This rank's memory (ZeRO owners hold different state per rank).
  MemoryPlan memory_of_rank(int rank) const;
  // The memory of rank `memory_rank` were one technique switched off, all else as planned
  // (`mop plan`'s "what each technique saved").
  enum class Technique { Slice, StreamGrads, ExchangeBudget };
  MemoryPlan memory_without(Technique t) const;
  // Per rank and parameter q (of the rank's layout): elements of its optimizer state on this
  // rank (0 when another replica owns it; the slice when sliced), and whether its gradients live
  // on the device only while its segment is in flight (sliced with one micro-batch, or streamed).
  int64_t state_numel(int rank, int q, int64_t numel) const;
  bool grads_in_flight(int q) const;
  // Streamed gradients: per segment of the rank's layout, whether its gradients are streamed (a
  // segment whose optimizer state is on the host, owned by this rank or not); empty without.
  std::vector<bool> streamed_segments() const;
  // Whether `rank` keeps parameter p's optimizer state (and updates it).
  // (Pipeline stages: only the ranks of the stage that runs its segment.)
  bool owns(int rank, int p) const;
  // Pipeline stages: the activation options of `rank`'s model chunk `chunk` (one model per chunk)
  // — the chunk's segments and a bank per pass of it its schedule keeps in flight (the plan's
  // options without a pipeline).
  ActivationOptions stage_activation_options(int rank, int chunk = 0) const;
  // Tokens per optimizer step (all ranks) and the model FLOPs of one step.
  int64_t tokens_per_step() const;
  double model_flops_per_step() const;
};

// Plans cfg (its parallel foldings validated against `world`) for `machine`. A plan that does
// not fit — device or host memory — is a UserError naming the tensor class, the sizes and the
// settings to change. check_fit: false leaves that to the caller (plan search). Fit::Time: as
// check_fit false, and a plan that does not fit is not timed (its `time` stays zero) unless its
// gradients are `auto` (whose choice compares the times).
enum class Fit { Check, Leave, Time };
Plan make_plan(const Config& cfg, const Machine& machine, int world, Fit fit);
inline Plan make_plan(const Config& cfg, const Machine& machine, int world, bool check_fit = true) {
  return make_plan(cfg, machine, world, check_fit ? Fit::Check : Fit::Leave);
}
// Whether the plan fits its machine's device and host memory (plan_overflow is "").
bool plan_fits(const Plan& p);
// Why the plan does not fit ("" when it does); `what` gets the memory and its largest class,
// e.g. "cuda memory: activations", or "host memory".
std::string plan_overflow(const Plan& plan, std::string* what = nullptr);

// Rows a rank receives per MoE chunk of `tokens` tokens under parallel.moe.exchange_budget
// `budget` (0: the worst case ep × tokens × top_k): max(1, ceil(budget × tokens × top_k)), at most
// the worst case. The same formula as the activations' receive buffers (model/activations.h).
int64_t bounded_receive_rows(double budget, int64_t tokens, int64_t top_k, int ep);
// Rounds a rank takes to receive its rows within `rows` (see kRoutingAllowance in plan.cpp).
int exchange_rounds(int64_t rows, int64_t tokens, int64_t top_k, int ep);

// Model FLOPs per token: 6·N_active + 6·S·heads·head_dim·layers (causal attention forward and
// backward), the MFU numerator.
double model_flops_per_token(const Config& cfg);

}  // namespace mop
