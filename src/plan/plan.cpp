// make_plan (see plan.h): placement, foldings, ZeRO owners, memory per rank and class, the fit
// check, and the time model; where state and saved tensors go is plan/placement.cpp's.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>
#include <optional>

#include "core/error.h"
#include "model/params.h"
#include "model/tiled_attention.h"
#include "optim/optimizer.h"
#include "plan/placement.h"
#include "runtime/memory.h"

namespace mop {

std::string RunPlacement::describe() const {
  return std::string(device_name(device)) + ", " + std::string(dtype_name(compute)) +
         " compute, " + std::string(dtype_name(grad)) + " gradients";
}

RunPlacement resolve_placement(const Config& cfg, Device available) {
  RunPlacement p;
  const auto& t = cfg.train;
  const bool cuda = t.device == "cuda" || (t.device == "auto" && available == Device::CUDA);
  if (cuda) {
    // The CUDA kernels compute in bf16 with fp32 accumulation, statistics and gradients.
    MOP_USER_CHECK(t.precision == "auto" || t.precision == "bf16", "train.precision: ", t.precision,
                   " is not available on the GPU (bf16 only); use auto or bf16, or train.device: cpu");
    p.device = Device::CUDA;
    p.compute = DType::BF16;
    p.grad = DType::F32;
    return p;
  }
  MOP_USER_CHECK(t.precision != "bf16", "train.precision: bf16 needs train.device: cuda; the CPU "
                 "backend runs fp32 or fp64");
  p.device = Device::CPU;
  p.compute = t.precision == "fp64" ? DType::F64 : DType::F32;
  p.grad = p.compute;
  return p;
}

bool use_ring_attention(const std::string& impl, int64_t num_heads, int64_t num_kv_heads, int cp) {
  if (cp <= 1 || impl == "ring") return cp > 1;
  const bool divisible = num_heads % cp == 0 && num_kv_heads % cp == 0;
  MOP_USER_CHECK(impl == "auto" || divisible, "parallel.attention.impl: ulysses needs model.num_heads (",
                 num_heads, ") and model.num_kv_heads (", num_kv_heads,
                 ") to divide by parallel.attention.cp (", cp, "); use ring or auto");
  return !divisible;
}

size_t MemoryPlan::device_total() const {
  return weights + grads + optimizer_state + host_grad_staging + activations + workspaces + batch + comms;
}

size_t MemoryPlan::host_total() const { return host_optimizer_state + host_staging + host_activations; }

double model_flops_per_token(const Config& cfg) {
  const ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  const ModelDims& d = layout.dims;
  return 6.0 * double(layout.num_active_params()) +
         6.0 * double(cfg.data.seq_len) * double(d.heads * d.head_dim) * double(d.layers);
}

int64_t Plan::tokens_per_step() const { return cfg.train.global_batch_size * cfg.data.seq_len; }

double Plan::model_flops_per_step() const {
  return model_flops_per_token(cfg) * double(tokens_per_step());
}

// The busiest rank's routed rows as a multiple of the balanced share T·k. Uniformly random tokens
// (our benchmarks) give every rank T·k rows in expectation, and the busiest of ep ranks is within a
// few standard deviations, √(T·k), of it: under 1% for the T·k ≥ 10^5 rows of the long-context
// plans. Trained routers, held near balance by the load-balancing loss, run more unevenly; the
// plan allows the busiest rank 25% over its share, so a budget of 1.25 or more takes one round.
constexpr double kRoutingAllowance = 1.25;

int64_t bounded_receive_rows(double budget, int64_t tokens, int64_t top_k, int ep) {
  ActivationOptions o;
  o.ep = ep, o.exchange_rows = exchange_rows(budget, tokens * top_k, ep);
  return receive_rows(o, tokens * top_k);
}

int exchange_rounds(int64_t rows, int64_t tokens, int64_t top_k, int ep) {
  const int64_t worst = int64_t(ep) * tokens * top_k;
  const int64_t busiest = std::min<int64_t>(worst, int64_t(std::ceil(kRoutingAllowance * double(tokens * top_k))));
  return rows <= 0 ? 1 : int((busiest + rows - 1) / rows);
}

const ModelLayout& Plan::local_layout() const {
  if (!local_layout_cache)
    local_layout_cache = std::make_shared<const ModelLayout>(ModelLayout::build(ModelDims::from(cfg, 0, ep)));
  return *local_layout_cache;
}

bool Plan::runs_segment(int rank, int s) const {
  if (pp == 1) return true;
  const int stage = stage_of(rank);
  for (int c = 0; c < pp_chunks; ++c) {
    const int v = c * pp + stage;
    if (s >= split.first[size_t(v)] && s < split.first[size_t(v + 1)]) return true;
  }
  return false;
}

std::vector<bool> Plan::held_segments(int rank) const {
  if (pp == 1) return {};
  std::vector<bool> held(size_t(num_segments(dims)));
  for (size_t s = 0; s < held.size(); ++s) held[s] = runs_segment(rank, int(s));
  return held;
}

bool Plan::owns(int rank, int p) const {
  return parallel.owns(rank, p) && (pp == 1 || runs_segment(rank, param_segment(local_layout(), p)));
}

namespace {
ActivationOptions chunk_options(const Plan& p, int stage, int c, const ActivationOptions& o);
}  // namespace

ActivationOptions Plan::stage_activation_options(int rank, int chunk) const {
  if (pp == 1) return activation_options;
  return chunk_options(*this, stage_of(rank), chunk, activation_options);
}

int64_t Plan::state_numel(int rank, int q, int64_t numel) const {
  if (!owns(rank, q)) return 0;
  if (parallel.params[size_t(q)].kind == Sharding::Slice) return aligned_numel(parallel.slice_numel(q, numel));
  return aligned_numel(numel);
}

bool Plan::grads_in_flight(int q) const {
  if (parallel.params[size_t(q)].kind == Sharding::Slice) return run.device != Device::CPU && micro_batches == 1;
  return stream_grads && !state_on_host.empty() && state_on_host[size_t(q)];
}

std::vector<bool> Plan::streamed_segments() const {
  if (!stream_grads || state_on_host.empty()) return {};
  const ModelLayout& local = local_layout();
  std::vector<bool> out(size_t(num_segments(dims)), false);
  for (size_t q = 0; q < local.params.size(); ++q)
    if (state_on_host[q]) out[size_t(param_segment(local, int(q)))] = true;
  return out;
}

namespace {

std::string count_text(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

std::string number_text(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%.3g", x);
  return buf;
}

// Bytes of the ops device's memory a micro-batch's workspaces take (device kinds only).
size_t workspace_bytes(const Plan& p) {
  if (p.run.device == Device::CPU) return 0;
  const double tokens = double(p.cfg.train.micro_batch_size) * p.local_seq;
  const double chunk = double(std::min<int64_t>(p.cfg.train.lm_head_chunk, int64_t(tokens)));
  // Attention's workspace grows with the tokens × heads of a call: a micro-batch's (Ulysses: all
  // S tokens of heads/cp heads), or one tile's of one sequence.
  const int64_t tile = p.activation_options.attention_tile;
  const double call = TiledAttention::tiled(tile, p.cfg.data.seq_len) ? double(tile) / p.cp : tokens;
  return size_t(p.machine.device.workspace_bytes + p.machine.device.workspace_bytes_per_token * call +
                chunk * double(p.dims.vocab) * 2.0);  // the LM head chunk's bf16 dlogits
}

// The device communicators one rank holds: world, cp, ep, edp, and the asynchronous ones.
int device_comms(const Plan& p) {
  if (p.world == 1 || p.run.device == Device::CPU) return 0;
  int n = 4;
  if (p.cfg.parallel.overlap_grad_reduce) n += 2;
  if (p.ring) n += 1;
  if (p.ep > 1) n += 2;
  if (p.parallel.sliced()) n += 2;  // the weight gathers' (world, edp)
  return n;
}

// The MoE block's chunk: pinned, or with recompute on micro-batches longer than kAutoMoeChunk
// tokens chunks of that many (the experts are recomputed anyway; 32768 tokens route 2048 rows to
// each of 128 experts, where the grouped GEMMs run near their best).
constexpr int64_t kAutoMoeChunk = 32768;
int64_t moe_chunk(const Config& cfg, int64_t tokens) {
  const int64_t c = cfg.train.moe_chunk;
  if (c >= 0) return c;
  return cfg.train.recompute && tokens > kAutoMoeChunk ? kAutoMoeChunk : 0;
}

// The query tile of the attention over whole sequences (model/tiled_attention.h): pinned
// (train.attention_tile ≥ 0), else on a GPU the one the time model makes fastest among tiles of
// S/2ᵏ ≥ kMinAttentionTile tokens — and whole sequences unless a tile saves more than
// kTileGain of attention's time, so a tile is taken only where the rates say it pays. Ring
// attention and the CPU backend run whole blocks / sequences.
constexpr int64_t kMinAttentionTile = 8192;
constexpr double kTileGain = 0.02;
int64_t attention_tile(const Plan& p) {
  const Config& cfg = p.cfg;
  const int64_t S = cfg.data.seq_len;
  if (cfg.train.attention_tile >= 0) {
    MOP_USER_CHECK(cfg.train.attention_tile == 0 || !p.ring, "train.attention_tile: ring attention "
                   "(parallel.attention.cp ", p.cp, " with heads that do not divide by it) runs its own "
                   "blocks; leave the tile at -1 or 0");
    MOP_USER_CHECK(p.run.device == Device::CPU || cfg.train.attention_tile != 1,
                   "train.attention_tile: tiles of one token cannot run on the GPU; use at least 2");
    return cfg.train.attention_tile;
  }
  if (p.ring || p.run.device == Device::CPU) return 0;
  const DeviceSpec& d = p.machine.device;
  const double B = double(cfg.train.micro_batch_size), Nq = double(p.dims.heads) / p.cp;
  const double q = Nq * double(p.dims.head_dim), kv = double(p.dims.kv_heads) / p.cp * double(p.dims.head_dim);
  const double c = double(dtype_size(p.run.compute)), fwd = 2 * B * double(S) * double(S) * q;
  auto seconds = [&](int64_t tile) {
    return attention_seconds(d, fwd, B, double(S), tile, q, kv, c, false) +
           attention_seconds(d, 2.5 * fwd, B, double(S), tile, q, kv, c, true);
  };
  const double whole = seconds(0);
  int64_t best = 0;
  double best_s = whole;
  for (int64_t n = 2; S % n == 0 && S / n >= kMinAttentionTile; n *= 2)
    if (const double s = seconds(S / n); s < best_s) best = S / n, best_s = s;
  return best_s < (1 - kTileGain) * whole ? best : 0;
}

// Pipeline stages: each pipeline rank's chunks, each planned as the model lays it out — its
// segments, a bank per pass of the chunk the schedule has begun and not yet finished backward
// (1F1B: up to pp − stage; the interleaved schedule more).
// Pipeline rank `stage`'s model chunk c: its virtual stage's segments and a bank for each of its
// passes the schedule keeps in flight at most.
ActivationOptions chunk_options(const Plan& p, int stage, int c, const ActivationOptions& o) {
  MOP_CHECK(stage >= 0 && stage < p.pp && c >= 0 && c < p.pp_chunks, "pipeline rank ", stage, " chunk ", c);
  const std::vector<PipePass> passes = p.pp_schedule == "interleaved"
                                           ? interleaved(stage, p.pp, p.micro_batches, p.pp_chunks)
                                           : one_f_one_b(stage, p.pp, p.micro_batches);
  int open = 0, most = 1;
  for (const PipePass& x : passes)
    if (x.chunk == c) open += x.forward ? 1 : -1, most = std::max(most, open);
  const int v = c * p.pp + stage;
  ActivationOptions chunk = o;
  chunk.first_segment = p.split.first[size_t(v)], chunk.end_segment = p.split.first[size_t(v + 1)];
  chunk.passes_in_flight = most;
  return chunk;
}

std::vector<std::vector<ActivationLayout>> plan_stage_activations(const Plan& p, const ModelDims& dims,
                                                                  const ActivationOptions& o) {
  std::vector<std::vector<ActivationLayout>> out(size_t(p.pp));
  for (int stage = 0; stage < p.pp; ++stage)
    for (int c = 0; c < p.pp_chunks; ++c) out[size_t(stage)].push_back(plan_activations(dims, chunk_options(p, stage, c, o)));
  return out;
}

void pipeline_activations(const Plan& p, int rank, MemoryPlan& m) {
  m.activations = m.host_activations = 0;
  m.activations_by_component = {};
  for (const ActivationLayout& a : p.stage_activations[size_t(p.stage_of(rank))]) {
    m.activations += a.device_bytes(), m.host_activations += a.host_bytes();
    const auto parts = a.device_by_component();
    for (size_t i = 0; i < parts.size(); ++i) m.activations_by_component[i] += parts[i];
  }
}

}  // namespace

// Per parameter q of the rank's layout (n elements, a aligned, k its slice when sliced):
//   weights    compute dtype: a, or k sliced (+ the gathered segments' sliced parameters whole, as
//              many as the step's shared weight slots: model/params.h, StepSlots);
//   gradients  grad dtype: a, or in flight (the segments being reduced or streamed, whole, as many
//              as its shared gradient slots),
//              + k for a sliced parameter whose state is on the device (its reduce-scattered slice);
//   state      fp32 master, m, v (12 bytes) of what the rank owns, on the device or the host;
//   staging    host-updated: bf16 gradients on the device (2 bytes; streamed: for the two
//              segments being converted), bf16 gradients and weights pinned (4); streamed with
//              several micro-batches also the fp32 running sums in host memory (4, every
//              parameter of a streamed segment); the CPU backend copies the fp32 gradients aside.
// Sliced (without streaming) and streamed stores are priced by building the store itself.
MemoryPlan Plan::memory_of_rank(int rank) const {
  const ModelLayout& local = local_layout();  // rank % ep's experts: the same shapes
  const bool gpu = run.device != Device::CPU;
  const size_t c = dtype_size(run.compute), g = dtype_size(run.grad);
  const int segments = num_segments(dims);
  MemoryPlan m;
  int64_t w_elems = 0, g_elems = 0, native = 0, host = 0, staged = 0, staged_cpu = 0, streamed = 0;
  std::vector<int64_t> gathered(size_t(segments), 0), in_flight(size_t(segments), 0);
  for (size_t q = 0; q < local.params.size(); ++q) {
    const int64_t n = local.params[q].numel(), a = aligned_numel(n);
    const bool sliced = parallel.params[q].kind == Sharding::Slice;
    const int64_t k = sliced ? aligned_numel(parallel.slice_numel(int(q), n)) : a;
    const int seg = param_segment(local, int(q));
    if (!runs_segment(rank, seg)) continue;  // another pipeline stage's
    const bool on_host = !state_on_host.empty() && state_on_host[q];
    w_elems += k;
    if (sliced) gathered[size_t(seg)] += a;
    if (grads_in_flight(int(q))) in_flight[size_t(seg)] += a; else g_elems += a;
    if (sliced && !on_host) g_elems += k;
    const int64_t state = state_numel(rank, int(q), n);
    if (state == 0) continue;
    (on_host ? host : native) += state;
    if (!on_host) continue;
    if (gpu && (sliced || grads_in_flight(int(q)))) streamed += state;
    else if (sliced) staged += k, staged_cpu += parallel.slice_numel(int(q), n);  // (pipeline stages)
    else staged += (n + 63) / 64 * 64, staged_cpu += n;
  }
  // The segments in flight at a time: one per shared slot of the step (model/params.h: what the
  // step program and the parameter store declare).
  const StepSlots slots = step_slots(parallel.sliced(), micro_batches == 1, stream_grads,
                                     local.lm_head == local.embedding);
  auto largest = [](std::vector<int64_t> v, int count) {
    std::sort(v.rbegin(), v.rend());
    int64_t sum = 0;
    for (size_t i = 0; i < v.size() && i < size_t(count); ++i) sum += v[i];
    return sum;
  };
  m.weights = size_t(w_elems + largest(gathered, slots.shared_weights)) * c;
  m.grads = size_t(g_elems + largest(in_flight, slots.shared_grads)) * g;
  // (Pipeline stages: the stage's parameters, in the stores below too.)
  if (parallel.sliced() && !stream_grads) {
    // What the step runs: the parameter store's slices and gather slots (model/params.h: the
    // shared slots of the largest segment, a tied embedding's own, a one-replica parameter in
    // place), every slice's gradients on the device, host-updated slices through the plain host
    // pipeline.
    const ParamStore store(local, run.compute, run.grad, MemKind::Host,
                           param_slices(parallel, rank, micro_batches, /*allocate=*/false), held_segments(rank));
    m.weights = store.weight_bytes(), m.grads = store.grad_bytes();
    staged = staged_cpu = streamed = 0;
    for (int q = 0; q < int(local.params.size()); ++q)
      if (!state_on_host.empty() && state_on_host[size_t(q)] && owns(rank, q))
        staged += aligned_numel(store.slice_numel(q)), staged_cpu += store.slice_numel(q);
  }
  size_t running_sums = 0;
  if (stream_grads && !state_on_host.empty()) {
    // What the step runs: the parameter store with the host-updated segments' gradients in the
    // shared slots (model/params.h), the host pipeline's staging (on the GPU bf16 for the two
    // segments being converted; pinned bf16 gradients and weights), and with several micro-batches
    // every streamed gradient's running sum in host memory (schedule/step.h).
    const ParamStore store(local, run.compute, run.grad, MemKind::Host, PooledGrads{streamed_segments(), false},
                           held_segments(rank));
    m.weights = store.weight_bytes(), m.grads = store.grad_bytes();
    std::vector<int64_t> by_segment(size_t(segments), 0);
    staged = staged_cpu = streamed = 0;
    for (size_t q = 0; q < local.params.size(); ++q) {
      const int64_t n = local.params[q].numel();
      if (!state_on_host[q] || !store.held(int(q))) continue;
      if (micro_batches > 1) running_sums += size_t(aligned_numel(n)) * g;
      if (!owns(rank, int(q))) continue;
      staged += aligned_numel(n), staged_cpu += n;
      by_segment[size_t(param_segment(local, int(q)))] += aligned_numel(n);
    }
    // The device's bf16 conversions: two buffers of the largest segment, in turn.
    streamed = 2 * *std::max_element(by_segment.begin(), by_segment.end());
  }
  m.optimizer_state = size_t(native) * 3 * sizeof(float) + local.params.size() * kGradNormBytes;
  m.host_optimizer_state = size_t(host) * 3 * sizeof(float);
  if (gpu && stream_grads) {
    m.host_grad_staging = size_t(streamed) * 2;
    m.host_staging = size_t(staged) * 4 + running_sums;
  } else if (gpu) {
    m.host_grad_staging = size_t(staged) * 2;  // bf16 on the device; bf16 gradients and weights pinned
    m.host_staging = size_t(staged) * 4 + size_t(streamed) * (sizeof(float) + c);
  } else {
    m.host_staging = size_t(staged_cpu) * sizeof(float) + running_sums;  // the gradients copied aside
  }
  m.activations = activations.device_bytes();
  m.activations_by_component = activations.device_by_component();
  m.host_activations = activations.host_bytes();
  if (pp > 1) pipeline_activations(*this, rank, m);
  m.workspaces = workspace_bytes(*this);
  const size_t tokens = size_t(cfg.train.micro_batch_size) * size_t(local_seq);
  m.batch = gpu ? 3 * tokens * sizeof(int32_t) : 0;
  m.comms = size_t(device_comms(*this)) * size_t(machine.device.comm_buffer_bytes);
  return m;
}

MemoryPlan Plan::memory_without(Technique t) const {
  Plan q = *this;
  switch (t) {
    case Technique::Slice: {
      q.parallel = make_parallel_spec(local_layout(), parallel.dims, cfg.parallel.zero, false);
      break;
    }
    case Technique::StreamGrads: q.stream_grads = false; break;
    case Technique::ExchangeBudget:  // the worst-case receive buffers
      q.cfg.parallel.moe.exchange_budget = 0, q.activation_options.exchange_rows = 0;
      q.activations = plan_activations(ModelDims::from(cfg, 0, ep), q.activation_options);
      if (pp > 1) q.stage_activations = plan_stage_activations(q, ModelDims::from(cfg, 0, ep), q.activation_options);
      break;
  }
  return q.memory_of_rank(memory_rank);
}

namespace {
// The memory a plan needs against what its machine has (plan_fits and plan_overflow).
struct Need {
  bool gpu;
  int per_node;
  double capacity, host_need, host_have;
  bool device_over, host_over;
  explicit Need(const Plan& p) {
    const MemoryPlan& m = p.memory;
    const Machine& mc = p.machine;
    gpu = p.run.device != Device::CPU;
    per_node = std::min(mc.gpus_per_node, p.world);
    // A device keeps its reserve free (allocator slack, plans its libraries build lazily).
    capacity = mc.device.memory_bytes - mc.device.reserve_bytes;
    host_need = gpu ? double(m.host_total()) * per_node : double(m.device_total() + m.host_total()) * per_node;
    host_have = gpu ? mc.host.memory_bytes * mc.host.pinned_fraction : mc.host.memory_bytes;
    device_over = gpu && double(m.device_total()) > capacity;
    host_over = host_need > host_have;
  }
};
}  // namespace

bool plan_fits(const Plan& p) {
  const Need n(p);
  return !n.device_over && !n.host_over;
}

std::string plan_overflow(const Plan& p, std::string* what) {
  const MemoryPlan& m = p.memory;
  const Machine& mc = p.machine;
  auto fmt = [](double b) { return format_bytes(b); };
  const Need n(p);
  const bool gpu = n.gpu;
  const int per_node = n.per_node;
  const double capacity = n.capacity;
  if (n.device_over) {
    // Name the class that dominates and what shrinks it.
    struct Part {
      const char* what;
      size_t bytes;
      std::string fix;
    };
    std::string act_fix = "lower data.seq_len or train.micro_batch_size, raise parallel.attention.cp";
    if (p.ep > 1 && p.cfg.parallel.moe.exchange_budget <= 0)
      act_fix += ", bound the expert exchange (parallel.moe.exchange_budget: 2)";
    if (!p.cfg.train.recompute) act_fix += ", or set train.recompute: true";
    const bool slice = p.parallel.sliced();
    std::string wg_fix = "raise parallel.moe.ep to shard the experts";
    if (!slice && p.world > 1) wg_fix += ", set parallel.shard: slice";
    if (p.host_params > 0 && !p.stream_grads) wg_fix += ", stream the gradients (optim.gradients: host)";
    std::string state_fix = "set optim.state_placement: auto or host";
    if (!slice && p.world > 1) state_fix += ", parallel.shard: slice, parallel.zero: true";
    state_fix += ", or raise parallel.moe.ep";
    const Part parts[] = {
        {"activations", m.activations, act_fix},
        {"weights and gradients", m.weights + m.grads, wg_fix},
        {"optimizer state", m.optimizer_state + m.host_grad_staging, state_fix},
        {"backend workspaces", m.workspaces, "lower train.lm_head_chunk"},
    };
    const Part* big = &parts[0];
    for (const Part& q : parts)
      if (q.bytes > big->bytes) big = &q;
    if (what) *what = std::string(device_name(p.run.device)) + " memory: " + big->what;
    const int64_t tokens = p.cfg.train.micro_batch_size * p.local_seq;
    return "the plan needs " + fmt(double(m.device_total())) + " of " + std::string(device_name(p.run.device)) +
           " memory per rank, but " + mc.name + " has " + fmt(capacity) + " (" +
           fmt(mc.device.memory_bytes) + " less a reserve of " + fmt(mc.device.reserve_bytes) +
           "): activations " + fmt(double(m.activations)) + " (one micro-batch of " +
           std::to_string(p.cfg.train.micro_batch_size) + " × " + std::to_string(p.local_seq) +
           " tokens per rank, " + std::to_string(tokens) + " tokens), weights and gradients " +
           fmt(double(m.weights + m.grads)) + ", optimizer state " +
           fmt(double(m.optimizer_state + m.host_grad_staging)) + ", workspaces " + fmt(double(m.workspaces)) +
           ". The largest is the " + big->what + "; to fit, " + big->fix;
  }
  const double host_need = n.host_need, host_have = n.host_have;
  if (n.host_over) {
    if (what) *what = "host memory";
    return "the plan needs " + fmt(host_need) + " of host memory per node (" + std::to_string(per_node) +
           " rank(s) × " + fmt(host_need / per_node) +
           (gpu ? ": optimizer state " + fmt(double(m.host_optimizer_state)) + ", staging " +
                      fmt(double(m.host_staging))
                : std::string()) +
           "), but " + mc.name + " has " + fmt(host_have) + (gpu ? " to pin" : "") +
           ". To fit, raise parallel.moe.ep or use more nodes, set parallel.zero: true" +
           (!p.parallel.sliced() && p.world > 1 ? std::string(" or parallel.shard: slice") : std::string()) +
           (gpu ? ", or keep more state on the GPU (optim.state_placement: auto or gpu)" : "");
  }
  return "";
}

namespace {

// make_plan with the gradients of host-updated segments streamed (`stream`) or not; time_unfit:
// false leaves a plan that does not fit untimed.
Plan plan_with(const Config& cfg, const Machine& machine, int world, bool stream, bool time_unfit) {
  validate_parallel(cfg, world);
  Plan p;
  p.cfg = cfg;
  p.machine = machine;
  p.world = world;
  p.run = resolve_placement(cfg, machine.device.kind);
  MOP_USER_CHECK(p.run.device == machine.device.kind || machine.device.kind == Device::CUDA,
                 "train.device: cuda, but machine ", machine.name, " has no GPU");
  p.dims = ModelDims::from(cfg);
  const auto& par = cfg.parallel;
  p.cp = int(par.attention.cp), p.dp = int(par.attention.dp);
  p.ep = int(par.moe.ep), p.edp = int(par.moe.dp);
  p.ring = use_ring_attention(par.attention.impl, cfg.model.num_heads, cfg.model.num_kv_heads, p.cp);
  p.moe_chunks = int(par.moe.chunks);
  if (p.cp > 1)
    MOP_USER_CHECK(cfg.data.seq_len % (2 * p.cp) == 0, "data.seq_len: ", cfg.data.seq_len,
                   " must divide into 2 × parallel.attention.cp (", 2 * p.cp,
                   ") chunks (each cp rank holds an early and a late chunk)");
  p.local_seq = int(cfg.data.seq_len / p.cp);
  p.micro_batches = int(cfg.train.global_batch_size / (cfg.train.micro_batch_size * p.dp));
  p.notes.push_back("step on " + p.run.describe());
  p.notes.push_back("attention: cp " + std::to_string(p.cp) + " × dp " + std::to_string(p.dp) +
                    (p.cp > 1 ? (p.ring ? ", ring attention" : ", Ulysses") : std::string()) +
                    "; experts: ep " + std::to_string(p.ep) + " × dp " + std::to_string(p.edp) +
                    (p.ep > 1 ? ", exchange in " + std::to_string(p.moe_chunks) + " chunk(s)" : std::string()));

  const ModelDims local_dims = ModelDims::from(cfg, 0, p.ep);
  const ModelLayout& local = p.local_layout();
  ActivationOptions& ao = p.activation_options;
  ao.max_batch = int(cfg.train.micro_batch_size);
  ao.max_seq = p.local_seq;
  ao.cp = p.cp, ao.ep = p.ep, ao.ring = p.ring;
  ao.recompute = cfg.train.recompute;
  ao.lm_head_chunk = cfg.train.lm_head_chunk;
  ao.moe_chunks = p.moe_chunks;
  ao.compute = p.run.compute;
  ao.moe_chunk = moe_chunk(cfg, int64_t(ao.max_batch) * ao.max_seq);
  ao.attention_tile = attention_tile(p);
  if (TiledAttention::tiled(ao.attention_tile, cfg.data.seq_len)) {
    const int64_t n = cfg.data.seq_len / ao.attention_tile;
    p.notes.push_back("attention: query tiles of " + std::to_string(ao.attention_tile) + " tokens (" +
                      std::to_string(n * (n + 1) / 2) + " blocks per sequence and pass)" +
                      (cfg.train.attention_tile < 0 ? ", the fastest by the measured rates" : ""));
  }
  ao.exchange_rows = exchange_rows(cfg.parallel.moe.exchange_budget,
                                   ao.chunk_tokens(int64_t(ao.max_batch) * ao.max_seq) * local_dims.top_k, ao.ep);
  p.pp = int(par.pp);
  p.pp_schedule = par.pipeline.schedule;
  p.pp_chunks = p.pp > 1 && p.pp_schedule == "interleaved" ? int(par.pipeline.virtual_stages) : 1;
  p.split.first = {0, num_segments(p.dims)};
  MeshDims mesh;
  mesh.pp = p.pp, mesh.dp = p.dp, mesh.cp = p.cp, mesh.edp = p.edp, mesh.ep = p.ep;
  p.parallel = make_parallel_spec(local, mesh, par.zero, par.shard == "slice");
  // On the CPU backend the gradients are in host memory already: streamed only when asked for
  // (optim.gradients: host), which runs the same schedule (the tests' way to check it).
  // (Pipeline stages keep whole gradients: streaming them between 1F1B's passes is not planned.)
  p.stream_grads = stream && (p.run.device != Device::CPU || cfg.optim.gradients == "host") && p.pp == 1;
  if (p.pp > 1) {
    // Pipeline stages: consecutive segments, the slowest stage as fast as can be (by the time of a
    // micro-batch's forward and backward through each segment; the earlier stages, which hold the
    // most passes in flight, the shorter where that ties).
    const std::vector<double> seconds = segment_seconds(p);
    const std::optional<StageSplit> split =
        split_stages(seconds, p.pp * p.pp_chunks, [](int, int, int) { return true; });
    MOP_USER_CHECK(split.has_value(), "parallel.pp: ", p.pp, " × ", p.pp_chunks, " virtual stages do not split the ",
                   num_segments(p.dims), " segments");
    // Interleaved: a rank's time is the sum of its virtual stages.
    p.split = balance_ranks(seconds, *split, p.pp);
    std::string stages;
    for (int v = 0; v < p.split.stages(); ++v)
      stages += (v ? ", " : "") + std::to_string(p.split.first[size_t(v + 1)] - p.split.first[size_t(v)]);
    p.notes.push_back("pipeline: pp " + std::to_string(p.pp) + ", " + p.pp_schedule +
                      (p.pp_chunks > 1 ? " over " + std::to_string(p.pp_chunks) + " chunks per rank" : std::string()) +
                      ", " + std::to_string(p.micro_batches) + " micro-batches per step; segments per virtual stage " +
                      stages + (p.pp_chunks > 1 ? " (balanced by their time over each rank's chunks)" : " (balanced by their time)"));
  }
  if (p.pp == 1) place_saved(p, local_dims);  // a pipeline stage keeps no attention, saves none on the host
  p.activations = plan_activations(local_dims, ao);
  if (p.pp > 1) p.stage_activations = plan_stage_activations(p, local_dims, ao);
  {
    const int64_t T = int64_t(ao.max_batch) * ao.max_seq;
    std::string note = "activations: ";
    note += ao.chunked(T) ? "MoE/FFN in chunks of " + std::to_string(ao.chunk_tokens(T)) + " tokens"
                          : "MoE/FFN over the whole micro-batch";
    if (ao.recompute) {
      note += "; recompute, " + std::to_string(ao.keep_attention) + " of " + std::to_string(p.dims.layers) +
              " layers keep their attention";
      if (ao.keep_attention_tail)
        note += ", the others its last " + std::to_string(ao.keep_attention_tail) + " of " +
                std::to_string(ao.max_seq / ao.attention_tile) + " query tiles";
      note += ", " + std::to_string(ao.host_layers) + " keep their saved tensors in host memory";
    }
    p.notes.push_back(note);
  }

  {
    const int64_t C = ao.chunk_tokens(int64_t(ao.max_batch) * ao.max_seq);
    p.exchange_rows = bounded_receive_rows(par.moe.exchange_budget, C, p.dims.top_k, p.ep);
    p.exchange_rounds = p.ep > 1 && par.moe.exchange_budget > 0
                            ? exchange_rounds(p.exchange_rows, C, p.dims.top_k, p.ep) : 1;
    if (p.ep > 1)
      p.notes.push_back(
          "expert exchange: " +
          (par.moe.exchange_budget > 0
               ? "receives up to " + std::to_string(p.exchange_rows) + " rows per MoE chunk of " +
                     std::to_string(C) + " tokens (budget " + number_text(par.moe.exchange_budget) +
                     " × tokens × top_k), " + std::to_string(p.exchange_rounds) + " round(s) expected"
               : "buffers for the worst case (" + std::to_string(p.exchange_rows) + " rows per MoE chunk of " +
                     std::to_string(C) + " tokens)"));
  }

  // State placement needs what the device holds besides the state: plan that first.
  size_t used = 0;
  if (p.stream_grads) {
    Plan trial = p;
    trial.state_on_host.assign(local.params.size(), true);
    used = trial.memory_of_rank(0).device_total();
  } else {
    const MemoryPlan base = p.memory_of_rank(0);
    used = base.weights + base.grads + base.activations + base.workspaces + base.batch + base.comms;
  }
  p.segment_on_host = place_state(p, local, used);
  if (p.pp > 1 && cfg.optim.state_placement == "auto" && p.run.device != Device::CPU) {
    // Pipeline stages: the stage's state on the device when all of it fits beside the rest (for
    // the rank that needs the most), else all of it on the host.
    Plan trial = p;
    trial.segment_on_host.assign(p.segment_on_host.size(), false);
    size_t most = 0;
    for (int k = 0; k < p.pp; ++k) most = std::max(most, trial.memory_of_rank(k * p.stage_size()).device_total());
    const double capacity = machine.device.memory_bytes - machine.device.reserve_bytes;
    p.segment_on_host.assign(p.segment_on_host.size(), double(most) > capacity);
  }
  const bool any_host = std::find(p.segment_on_host.begin(), p.segment_on_host.end(), true) !=
                        p.segment_on_host.end();
  if (any_host) {
    p.state_on_host.assign(local.params.size(), false);
    for (size_t q = 0; q < local.params.size(); ++q)
      p.state_on_host[q] = p.segment_on_host[size_t(param_segment(local, int(q)))];
    const ModelLayout whole = ModelLayout::build(p.dims);
    for (size_t q = 0; q < whole.params.size(); ++q)
      if (p.segment_on_host[size_t(param_segment(whole, int(q)))]) p.host_params += whole.params[q].numel();
  }
  // Streaming concerns the host-updated parameters that are not sliced (a sliced one's slice goes
  // to the host as its reduce-scatter ends anyway).
  bool whole_on_host = false;
  for (size_t q = 0; q < p.state_on_host.size(); ++q)
    whole_on_host |= p.state_on_host[q] && p.parallel.params[q].kind != Sharding::Slice;
  if (!whole_on_host) p.stream_grads = false;
  if (p.run.device != Device::CPU || any_host) {
    int host_segments = 0;
    for (bool h : p.segment_on_host) host_segments += h;
    p.notes.push_back("optimizer state (" + cfg.optim.state_placement + "): " +
                      std::to_string(host_segments) + " of " + std::to_string(p.segment_on_host.size()) +
                      " segments in host memory (" + count_text(double(p.host_params)) +
                      " parameters, all ranks)");
  }

  if (p.parallel.sliced()) {
    int64_t dense = 0, experts = 0;
    for (size_t q = 0; q < p.parallel.params.size(); ++q)
      if (p.parallel.params[q].kind == Sharding::Slice)
        ++(p.parallel.expert(int(q)) ? experts : dense);
    p.notes.push_back("parameters sliced (parallel.shard: slice): " + std::to_string(dense) +
                      " dense over cp × dp = " + std::to_string(p.cp * p.dp) + ", " + std::to_string(experts) +
                      " expert tensors over dp " + std::to_string(p.edp) +
                      (p.edp == 1 ? " (one replica: whole)" : "") +
                      "; each segment gathered before its forward and backward, two in flight; gradients " +
                      (p.micro_batches == 1 ? "reduce-scattered as each segment's backward ends"
                                            : "summed whole over the micro-batches, reduce-scattered after the last"));
  } else if (par.shard == "slice") {
    p.notes.push_back("parallel.shard: slice: every parameter has one replica, nothing to slice");
  }
  if (whole_on_host && p.run.device != Device::CPU)
    p.notes.push_back(std::string("gradients of host-updated segments (optim.gradients ") + cfg.optim.gradients +
                      "): " + (p.stream_grads ? std::string("streamed: on the GPU only for the two segments in flight, to the "
                                                "host as each segment's last backward ends") +
                                                (p.micro_batches > 1 ? "; between micro-batches their fp32 running "
                                                                       "sums wait in host memory" : "")
                                              : "whole on the GPU, to the host once final"));
  else if (any_host && p.run.device != Device::CPU)
    p.notes.push_back("gradients of host-updated segments: sliced, each slice (fp32, on the GPU) to the "
                      "host once reduce-scattered");

  // The rank that needs the most device memory (ZeRO owners and pipeline stages differ).
  p.memory = p.memory_of_rank(0);
  for (int r = 1; r < world; ++r) {
    if (!p.parallel.zero1() && r % p.stage_size() != 0) continue;
    MemoryPlan m = p.memory_of_rank(r);
    if (m.device_total() > p.memory.device_total()) p.memory = m, p.memory_rank = r;
  }
  if (time_unfit || plan_fits(p)) p.time = predict_step_time(p);
  return p;
}

}  // namespace

Plan make_plan(const Config& cfg, const Machine& machine, int world, Fit fit) {
  const std::string& g = cfg.optim.gradients;
  MOP_USER_CHECK(g != "host" || cfg.optim.state_placement != "gpu",
                 "optim.gradients: host streams the gradients of the segments whose optimizer state is on "
                 "the host, but optim.state_placement: gpu keeps every segment's on the GPU; use "
                 "optim.gradients: auto or gpu, or optim.state_placement: auto or host");
  MOP_USER_CHECK(g != "host" || cfg.parallel.pp == 1, "optim.gradients: host with parallel.pp ", cfg.parallel.pp,
                 ": pipeline stages keep whole gradients; use optim.gradients: auto or gpu");
  const bool time_unfit = fit != Fit::Time || g == "auto";
  Plan p = plan_with(cfg, machine, world, g == "host", time_unfit);
  if (g == "auto" && p.host_params > 0 && p.run.device != Device::CPU) {
    // Streamed when only that fits, or when it is not slower.
    Plan s = plan_with(cfg, machine, world, true, time_unfit);
    const bool fits = plan_fits(p), fits_s = plan_fits(s);
    if (s.stream_grads && ((fits_s && !fits) || (fits_s == fits && s.time.step <= p.time.step))) p = std::move(s);
  }
  if (fit == Fit::Check) {
    const std::string overflow = plan_overflow(p);
    MOP_USER_CHECK(overflow.empty(), overflow);
  }
  return p;
}

}  // namespace mop
