// make_plan (see plan.h): placement, foldings, ZeRO owners, optimizer-state placement, memory per
// rank and class, the fit check, and the time model.
#include "plan/plan.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <numeric>

#include "core/error.h"
#include "core/memory.h"
#include "model/params.h"

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

namespace {

std::string count_text(double n) {
  char buf[32];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2fB", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2fM", n / 1e6);
  else std::snprintf(buf, sizeof buf, "%.0f", n);
  return buf;
}

// Bytes of the ops device's memory a micro-batch's workspaces take (device kinds only).
size_t workspace_bytes(const Plan& p) {
  if (p.run.device == Device::CPU) return 0;
  const double tokens = double(p.cfg.train.micro_batch_size) * p.local_seq;
  const double chunk = double(std::min<int64_t>(p.cfg.train.lm_head_chunk, int64_t(tokens)));
  return size_t(p.machine.device.workspace_bytes + p.machine.device.workspace_bytes_per_token * tokens +
                chunk * double(p.dims.vocab) * 2.0);  // the LM head chunk's bf16 dlogits
}

// The device communicators one rank holds: world, cp, ep, edp, and the asynchronous ones.
int device_comms(const Plan& p) {
  if (p.world == 1 || p.run.device == Device::CPU) return 0;
  int n = 4;
  if (p.cfg.parallel.overlap_grad_reduce) n += 2;
  if (p.ring) n += 1;
  if (p.ep > 1) n += 2;
  return n;
}

// Optimizer-state placement per segment. auto: everything on the host costs 2 bytes per
// parameter on the device (bf16 gradient staging); moving a segment's state to the device costs
// 10 more. Segments move in the order the next forward needs them (embedding, layer 0, …), whose
// host updates would be exposed first, while the device has room (less its reserve).
std::vector<bool> place_state(Plan& p, const ModelLayout& local, size_t device_used) {
  const int segments = num_segments(p.dims);
  const std::string& mode = p.cfg.optim.state_placement;
  if (p.run.device == Device::CPU) {
    if (mode != "host") return std::vector<bool>(size_t(segments), false);
    MOP_USER_CHECK(p.run.compute == DType::F32, "optim.state_placement: host on the CPU needs "
                   "train.precision fp32 (the host engine reads fp32 or bf16 gradients)");
    return std::vector<bool>(size_t(segments), true);
  }
  if (mode == "gpu") return std::vector<bool>(size_t(segments), false);
  if (mode == "host") return std::vector<bool>(size_t(segments), true);
  std::vector<double> elems(size_t(segments), 0);
  for (int q = 0; q < int(local.params.size()); ++q)
    elems[size_t(param_segment(local, q))] += double(aligned_numel(local.params[q].numel()));
  const double free = p.machine.device.memory_bytes - p.machine.device.reserve_bytes - double(device_used);
  double need = 0;
  for (double e : elems) need += 2.0 * e;
  std::vector<bool> on_host(size_t(segments), true);
  for (int s = 0; s < segments && need + 10.0 * elems[size_t(s)] <= free; ++s) {
    on_host[size_t(s)] = false;
    need += 10.0 * elems[size_t(s)];
  }
  return on_host;
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

// With recompute: which layers keep their attention output (layers [0, keep)) and which keep their
// saved tensors in pinned host memory (layers [0, host)). Pinned counts are taken as given; the
// plan's choice keeps as many attention outputs as memory holds (each saves a recomputed
// attention) with as few host layers as the device needs (their copies hide behind the layers'
// compute), planned with every optimizer state that may live on the host there — the state takes
// what device memory is left afterwards (place_state).
void place_saved(Plan& p, const ModelDims& local_dims) {
  ActivationOptions& ao = p.activation_options;
  const Config& cfg = p.cfg;
  const int L = int(p.dims.layers);
  ao.host_layers = ao.keep_attention = 0;
  if (!ao.recompute) return;
  const bool can_keep = p.cp == 1 || p.ring;
  const int pin_keep = int(cfg.train.keep_attention), pin_host = int(cfg.train.offload_layers);
  if (p.run.device == Device::CPU) {  // one memory: nothing to offload
    ao.keep_attention = pin_keep >= 0 ? pin_keep : (can_keep ? L : 0);
    ao.host_layers = std::max(0, pin_host);
    return;
  }
  const std::string& mode = cfg.optim.state_placement;
  const ModelLayout local = ModelLayout::build(local_dims);
  Plan trial = p;
  if (mode != "gpu") trial.state_on_host.assign(local.params.size(), true);
  // Only the activations change from trial to trial.
  trial.activations = plan_activations(local_dims, trial.activation_options);
  const MemoryPlan base = trial.memory_of_rank(0);
  auto fits = [&](int keep, int host) {
    trial.activation_options.keep_attention = keep, trial.activation_options.host_layers = host;
    const ActivationLayout act = plan_activations(local_dims, trial.activation_options);
    trial.memory = base;
    trial.memory.activations = act.device_bytes();
    trial.memory.host_activations = act.host_bytes();
    return plan_overflow(trial).empty();
  };
  const int keep_hi = pin_keep >= 0 ? pin_keep : (can_keep ? L : 0), keep_lo = pin_keep >= 0 ? pin_keep : 0;
  const int host_lo = pin_host >= 0 ? pin_host : 0, host_hi = pin_host >= 0 ? pin_host : L;
  // More host layers take device memory off and put host memory on; more kept layers take both.
  // So for each kept count the fewest host layers that fit the device is a bisection, and the
  // kept counts that fit at all are a prefix from keep_lo: bisect them too.
  auto fewest_host = [&](int keep) {  // -1: no host count fits
    if (!fits(keep, host_hi)) {
      // The device may not fit even with every layer on the host, or the host may not: try the
      // device-side end too (host memory only grows with host layers).
      for (int h = host_lo; h < host_hi; ++h)
        if (fits(keep, h)) return h;
      return -1;
    }
    int lo = host_lo, hi = host_hi;  // fits(hi)
    while (lo < hi) {
      const int mid = (lo + hi) / 2;
      if (fits(keep, mid)) hi = mid; else lo = mid + 1;
    }
    return lo;
  };
  if (int h = fewest_host(keep_hi); h >= 0) {
    ao.keep_attention = keep_hi, ao.host_layers = h;
    return;
  }
  int lo = keep_lo, hi = keep_hi - 1, best = -1, best_host = -1;  // the most kept layers that fit
  while (lo <= hi) {
    const int mid = (lo + hi) / 2;
    if (int h = fewest_host(mid); h >= 0) best = mid, best_host = h, lo = mid + 1; else hi = mid - 1;
  }
  if (best >= 0) {
    ao.keep_attention = best, ao.host_layers = best_host;
    return;
  }
  ao.keep_attention = keep_lo, ao.host_layers = host_hi;  // does not fit: the fit check says why
}

}  // namespace

MemoryPlan Plan::memory_of_rank(int rank) const {
  const ModelLayout local = ModelLayout::build(ModelDims::from(cfg, rank % ep, ep));
  const bool gpu = run.device != Device::CPU;
  MemoryPlan m;
  int64_t elems = 0, native = 0, host = 0, staged = 0, staged_cpu = 0;
  for (size_t q = 0; q < local.params.size(); ++q) {
    const int64_t n = local.params[q].numel(), a = aligned_numel(n);
    elems += a;
    const bool on_host = !state_on_host.empty() && state_on_host[q];
    if (!owns(rank, int(q))) continue;
    (on_host ? host : native) += a;
    if (on_host) staged += (n + 63) / 64 * 64, staged_cpu += n;
  }
  m.weights = size_t(elems) * dtype_size(run.compute);
  m.grads = size_t(elems) * dtype_size(run.grad);
  m.optimizer_state = size_t(native) * 3 * sizeof(float) + local.params.size() * dtype_size(acc_dtype(run.grad));
  m.host_optimizer_state = size_t(host) * 3 * sizeof(float);
  if (gpu) {
    m.host_grad_staging = size_t(staged) * 2;  // bf16 on the device; bf16 gradients and weights pinned
    m.host_staging = size_t(staged) * 4;
  } else {
    m.host_staging = size_t(staged_cpu) * sizeof(float);  // the gradients copied aside
  }
  m.activations = activations.device_bytes();
  m.activations_by_component = activations.device_by_component();
  m.host_activations = activations.host_bytes();
  m.workspaces = workspace_bytes(*this);
  const size_t tokens = size_t(cfg.train.micro_batch_size) * size_t(local_seq);
  m.batch = gpu ? 3 * tokens * sizeof(int32_t) : 0;
  m.comms = size_t(device_comms(*this)) * size_t(machine.device.comm_buffer_bytes);
  return m;
}

std::string plan_overflow(const Plan& p, std::string* what) {
  const MemoryPlan& m = p.memory;
  const Machine& mc = p.machine;
  auto fmt = [](double b) { return format_bytes(b); };
  const bool gpu = p.run.device != Device::CPU;
  const int per_node = std::min(mc.gpus_per_node, p.world);
  // A device keeps its reserve free (allocator slack, plans its libraries build lazily).
  const double capacity = mc.device.memory_bytes - mc.device.reserve_bytes;
  if (gpu && double(m.device_total()) > capacity) {
    // Name the class that dominates and what shrinks it.
    struct Part {
      const char* what;
      size_t bytes;
      std::string fix;
    };
    std::string act_fix = "lower data.seq_len or train.micro_batch_size, raise parallel.attention.cp";
    if (!p.cfg.train.recompute) act_fix += ", or set train.recompute: true";
    const Part parts[] = {
        {"activations", m.activations, act_fix},
        {"weights and gradients", m.weights + m.grads, "raise parallel.moe.ep to shard the experts"},
        {"optimizer state", m.optimizer_state + m.host_grad_staging,
         "set optim.state_placement: auto or host, parallel.zero: true, or raise parallel.moe.ep"},
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
  const double host_need = gpu ? double(m.host_total()) * per_node
                               : double(m.device_total() + m.host_total()) * per_node;
  const double host_have = gpu ? mc.host.memory_bytes * mc.host.pinned_fraction : mc.host.memory_bytes;
  if (host_need > host_have) {
    if (what) *what = "host memory";
    return "the plan needs " + fmt(host_need) + " of host memory per node (" + std::to_string(per_node) +
           " rank(s) × " + fmt(host_need / per_node) +
           (gpu ? ": optimizer state " + fmt(double(m.host_optimizer_state)) + ", staging " +
                      fmt(double(m.host_staging))
                : std::string()) +
           "), but " + mc.name + " has " + fmt(host_have) + (gpu ? " to pin" : "") +
           ". To fit, raise parallel.moe.ep or use more nodes, set parallel.zero: true" +
           (gpu ? ", or keep more state on the GPU (optim.state_placement: auto or gpu)" : "");
  }
  return "";
}

Plan make_plan(const Config& cfg, const Machine& machine, int world, bool check_fit) {
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
  const ModelLayout local = ModelLayout::build(local_dims);
  ActivationOptions& ao = p.activation_options;
  ao.max_batch = int(cfg.train.micro_batch_size);
  ao.max_seq = p.local_seq;
  ao.cp = p.cp, ao.ep = p.ep, ao.ring = p.ring;
  ao.recompute = cfg.train.recompute;
  ao.lm_head_chunk = cfg.train.lm_head_chunk;
  ao.moe_chunks = p.moe_chunks;
  ao.compute = p.run.compute;
  ao.moe_chunk = moe_chunk(cfg, int64_t(ao.max_batch) * ao.max_seq);
  ao.exchange_rows = exchange_rows(cfg.parallel.moe.exchange_budget,
                                   ao.chunk_tokens(int64_t(ao.max_batch) * ao.max_seq) * local_dims.top_k, ao.ep);
  p.parallel = make_parallel_spec(local, p.cp, p.dp, p.ep, p.edp, par.zero, par.shard == "slice");
  place_saved(p, local_dims);
  p.activations = plan_activations(local_dims, ao);
  {
    const int64_t T = int64_t(ao.max_batch) * ao.max_seq;
    std::string note = "activations: ";
    note += ao.chunked(T) ? "MoE/FFN in chunks of " + std::to_string(ao.chunk_tokens(T)) + " tokens"
                          : "MoE/FFN over the whole micro-batch";
    if (ao.recompute)
      note += "; recompute, " + std::to_string(ao.keep_attention) + " of " + std::to_string(p.dims.layers) +
              " layers keep their attention, " + std::to_string(ao.host_layers) +
              " keep their saved tensors in host memory";
    p.notes.push_back(note);
  }

  // State placement needs what the device holds besides the state: plan that first.
  MemoryPlan base = p.memory_of_rank(0);
  const size_t used = base.weights + base.grads + base.activations + base.workspaces + base.batch + base.comms;
  p.segment_on_host = place_state(p, local, used);
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
  if (p.run.device != Device::CPU || any_host) {
    int host_segments = 0;
    for (bool h : p.segment_on_host) host_segments += h;
    p.notes.push_back("optimizer state (" + cfg.optim.state_placement + "): " +
                      std::to_string(host_segments) + " of " + std::to_string(p.segment_on_host.size()) +
                      " segments in host memory (" + count_text(double(p.host_params)) +
                      " parameters, all ranks)");
  }

  // The rank that needs the most device memory (ZeRO owners differ).
  p.memory = p.memory_of_rank(0);
  for (int r = 1; r < world && p.parallel.zero1(); ++r) {
    MemoryPlan m = p.memory_of_rank(r);
    if (m.device_total() > p.memory.device_total()) p.memory = m, p.memory_rank = r;
  }
  if (check_fit) {
    const std::string overflow = plan_overflow(p);
    MOP_USER_CHECK(overflow.empty(), overflow);
  }
  p.time = predict_step_time(p);
  return p;
}

}  // namespace mop
