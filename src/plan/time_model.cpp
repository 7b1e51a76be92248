// The time model (see time_model.h). Shapes follow transformer.cpp: T tokens of a micro-batch on
// this rank, H hidden, Q = heads·D, KV = kv_heads·D, E experts (E_l on this rank), K top-k, F an
// expert's FFN width, V vocabulary; c bytes per compute element, 4 per acc element.
#include "plan/time_model.h"

#include <algorithm>
#include <cmath>

#include "model/params.h"
#include "model/tiled_attention.h"
#include "parallel/mesh.h"
#include "plan/op_bytes.h"
#include "plan/plan.h"
#include "plan/program.h"
#include "plan/step_walk.h"

namespace mop {

static_assert(kNumOpCategories == 8, "DeviceSpec::in_step has one factor per OpCategory");

double StepTime::compute() const {
  double s = 0;
  for (int c = 0; c < kNumOpCategories; ++c)
    if (OpCategory(c) != OpCategory::Communication) s += seconds[size_t(c)];
  return s;
}

double StepTime::tokens_per_second(const Plan& plan) const {
  return step > 0 ? double(plan.tokens_per_step()) / step : 0.0;
}

double StepTime::mfu(const Plan& plan) const {
  const double peak = plan.machine.device.peak_flops * plan.world;
  return step > 0 && peak > 0 ? plan.model_flops_per_step() / step / peak : 0.0;
}

namespace {

enum class Phase { Forward, Backward, Recompute };
enum class Pass { Fwd, Dgrad, Wgrad };

// A group of ranks' place on the machine: its size and how many of them share a node.
struct Group {
  int size = 1, per_node = 1;
};

class Model {
 public:
  // Priced as `rank`'s step: its groups, its pipeline stage's segments.
  Model(const Plan& p, int rank) : p_(p), d_(p.machine.device), l_(p.machine.link), st_(), rank_(rank) {
    // Ranks are laid out node by node (parallel/mesh.h): cp and ep groups are consecutive ranks,
    // dp/edp strided, pipeline stages outermost.
    const Mesh mesh = p.parallel.mesh();
    auto group = [&](Axes axes) {
      return Group{mesh.size(axes), mesh.on_node(axes, rank, p.machine.gpus_per_node)};
    };
    if (p.pp > 1) {
      // A message goes to the same position in the next stage: on this node when it holds both.
      const int next = (p_.stage_of(rank) + 1) % p.pp * p.stage_size() + rank % p.stage_size();
      const int node = p.machine.gpus_per_node;
      neighbour_ = Group{2, rank / node == next / node ? 2 : 1};
    }
    cp_group_ = group(Axes{Axis::Cp});
    ep_group_ = group(Axes{Axis::Ep});
    dense_group_ = group(kDenseReplicas);
    edp_group_ = group(kExpertReplicas);
    c_ = double(dtype_size(p.run.compute));
  }

  StepTime run() {
    WalkCosts w;
    const StepProgram program = price(w);
    return finish(walk_step(program, w));
  }
  // Every action's costs for this rank's program (returned); then the step from its walk.
  StepProgram price(WalkCosts& w);
  // The forward and backward of one micro-batch through each of the rank's segments.
  void price_segments(WalkCosts& w);
  StepTime finish(const WalkResult& r);

 private:
  bool runs(int segment) const { return p_.runs_segment(rank_, segment); }
  // ---- pricing -------------------------------------------------------------------------------
  // Adds `seconds` of `cat` (scaled by its in-step factor) to the step, `repeat_` times; returns
  // the scaled seconds of one.
  double charge(OpCategory cat, double seconds) {
    if (cat != OpCategory::Communication) seconds *= d_.in_step[size_t(cat)];
    st_.seconds[size_t(cat)] += seconds * repeat_;
    ComponentTime& c = st_.components[size_t(component_)];
    (phase_ == Phase::Forward ? c.forward : phase_ == Phase::Backward ? c.backward : c.recompute) +=
        seconds * repeat_;
    return seconds;
  }
  void flop(double f) { st_.components[size_t(component_)].flops += f * repeat_; }
  void gemm(double m, double n, double k, Pass pass, double slowdown = 1) {
    const double f = 2 * m * n * k;
    if (f <= 0) return;
    const RateTable& t = pass == Pass::Fwd ? d_.gemm_fwd : pass == Pass::Dgrad ? d_.gemm_dgrad : d_.gemm_wgrad;
    charge(OpCategory::DenseGemm, f / t.at(f) * slowdown + d_.launch_seconds);
    flop(f);
  }
  // Grouped GEMMs over `rows` routed rows in all, in launches of `rows_per_call` (one chunk).
  void grouped(double rows, double n, double k, Pass pass, double slowdown, double rows_per_call) {
    const double f = 2 * rows * n * k;
    if (f <= 0) return;
    const double calls = std::max(1.0, std::round(rows / rows_per_call));
    const double local = double(std::max<int64_t>(1, p_.dims.experts / p_.ep));
    const double per_expert = rows_per_call / local;
    const RateTable& t = pass == Pass::Fwd ? d_.grouped_fwd : pass == Pass::Dgrad ? d_.grouped_dgrad : d_.grouped_wgrad;
    const double by_experts = d_.grouped_experts.empty() ? 1.0 : d_.grouped_experts.at(local);
    charge(OpCategory::Experts, f / (t.at(std::max(1.0, per_expert)) * by_experts) * slowdown + calls * d_.launch_seconds);
    flop(f);
  }
  void mem(OpCategory cat, double bytes, double bw) {
    charge(cat, (bw > 0 ? bytes / bw : 0) + d_.launch_seconds);
  }
  void sync() { charge(OpCategory::Other, d_.sync_seconds); }
  // Bus-bandwidth time of a collective over `g` moving `bytes` per rank.
  double collective(double bytes, Group g, double node_bw, double net_bw, double bus_factor) const {
    if (g.size <= 1 || bytes <= 0) return 0;
    const bool net = g.per_node < g.size;
    const double bw = net ? net_bw : node_bw;
    return (bw > 0 ? bytes * bus_factor / bw : 0) + (net ? l_.net_latency : l_.node_latency);
  }
  double all_to_all(double bytes, Group g) const {
    return collective(bytes, g, l_.node_all_to_all, l_.net_all_to_all, double(g.size - 1) / g.size);
  }
  double all_reduce(double bytes, Group g) const {
    return collective(bytes, g, l_.node_all_reduce, l_.net_all_reduce, 2.0 * (g.size - 1) / g.size);
  }
  double send_recv(double bytes, Group g) const {
    return collective(bytes, g, l_.node_send_recv, l_.net_send_recv, 1.0);
  }
  // All-gather and reduce-scatter of `bytes` (the whole tensor) per rank: a ring all-reduce is one
  // of each, so their bus bandwidth is the all-reduce's (nccl-tests' busBw), half its bus bytes.
  double all_gather(double bytes, Group g) const {
    return collective(bytes, g, l_.node_all_reduce, l_.net_all_reduce, double(g.size - 1) / g.size);
  }
  double reduce_scatter(double bytes, Group g) const { return all_gather(bytes, g); }
  // A collective on the compute stream: all of it exposed.
  void exposed_comm(double seconds) {
    charge(OpCategory::Communication, seconds);
    ComponentTime& c = st_.components[size_t(component_)];
    c.comm_total += seconds * repeat_, c.comm_exposed += seconds * repeat_;
    st_.comm_total += seconds * repeat_;
  }
  // A collective beside the compute, of which `exposed` seconds hold up the compute stream.
  void overlapped_comm(double seconds, double exposed) {
    charge(OpCategory::Communication, exposed);
    ComponentTime& c = st_.components[size_t(component_)];
    c.comm_total += seconds * repeat_, c.comm_exposed += exposed * repeat_;
    st_.comm_total += seconds * repeat_;
  }

  // ---- the model's ops -----------------------------------------------------------------------
  void norm(double rows, double cols, bool backward) {
    mem(OpCategory::Other, op_bytes::norm(rows, cols, c_, backward), d_.norm_bw);
  }
  void ulysses(double width, int times);
  // head < 1: the recompute of a layer that keeps the last tiles of its attention output runs
  // the first head·S query rows only (causal attention over that prefix; cp 1).
  void attention_fwd(double T, double head = 1);
  void attention_bwd(double T);
  double whole_sequence_attention(double flops, bool backward, double head = 1) const;
  void layer_fwd(int l, double T);
  void layer_bwd(int l, double T);
  void moe_fwd(double T);
  void moe_bwd(double T);
  void experts_fwd_chunks(double T);
  void ffn(double T, double F, bool backward);
  void ffn_gate_up(double T, double F);  // a chunked FFN's backward recomputes gate/up and SwiGLU
  void offload(std::vector<double>& fwd, std::vector<double>& bwd, double T);
  void experts(double T, bool backward);
  double chunk(double T) const { return double(p_.activation_options.chunk_tokens(int64_t(T))); }
  bool chunked(double T) const { return chunk(T) < T; }
  void optimizer(const StepProgram& program, WalkCosts& w);
  void action_costs(WalkCosts& w);
  bool sliced(size_t q) const { return p_.parallel.params[q].kind == Sharding::Slice; }
  void set(int component, Phase phase) { component_ = component, phase_ = phase; }

  const Plan& p_;
  const DeviceSpec& d_;
  const LinkSpec& l_;
  StepTime st_;
  Group cp_group_, ep_group_, dense_group_, edp_group_;
  const Group& replicas(size_t q) const {
    return p_.parallel.expert(int(q)) ? edp_group_ : dense_group_;
  }
  double c_ = 2;
  int rank_ = 0;
  Group neighbour_;    // a pipeline message's two ranks
  double repeat_ = 1;  // micro-batches the ops being priced run for
  int component_ = 0;
  Phase phase_ = Phase::Forward;
};

enum Comp { kEmbedding, kAttention, kRouter, kExperts, kDenseFfn, kLmHead, kOptimizer, kGradSums, kGathers };
constexpr int kNumComp = kNumStepComponents;
const char* kCompNames[kNumComp] = {"embedding", "attention", "router", "experts", "dense FFN",
                                    "LM head + loss", "optimizer", "gradient sums", "weight gathers"};
static_assert(int(StepComponent::GradSums) == kGradSums && int(StepComponent::Experts) == kExperts &&
              int(StepComponent::Gathers) == kGathers);

// The Ulysses exchange of `times` tensors of `width` elements per token: a gather, an all-to-all
// on the compute stream and a gather each.
void Model::ulysses(double width, int times) {
  const double T = double(p_.cfg.train.micro_batch_size) * p_.local_seq;
  for (int i = 0; i < times; ++i) {
    mem(OpCategory::RouterPermute, op_bytes::gather(T, width, c_), d_.permute_bw);
    exposed_comm(all_to_all(T * width * c_, cp_group_));
    mem(OpCategory::RouterPermute, op_bytes::gather(T, width, c_), d_.permute_bw);
  }
}

// Attention over whole sequences (cp 1, or Ulysses' heads/cp), in the plan's query tiles.
double Model::whole_sequence_attention(double flops, bool backward, double head) const {
  const ModelDims& d = p_.dims;
  return attention_seconds(d_, flops, double(p_.cfg.train.micro_batch_size), head * double(p_.cfg.data.seq_len),
                           p_.activation_options.attention_tile, double(d.q_width()) / p_.cp,
                           double(d.kv_width()) / p_.cp, c_, backward);
}

void Model::attention_fwd(double T, double head) {
  const ModelDims& d = p_.dims;
  const double B = p_.cfg.train.micro_batch_size, S = head * double(p_.cfg.data.seq_len);
  const double D = double(d.head_dim), Nq = double(d.heads);
  const double causal = 2 * B * S * S * Nq * D / p_.cp;  // this rank's share of the causal FLOPs
  MOP_CHECK(head == 1 || (p_.cp == 1 && !p_.ring), "a recomputed prefix of attention needs cp 1");
  if (p_.cp > 1 && !p_.ring) {
    ulysses(double(d.q_width()) / p_.cp, 1);
    ulysses(double(d.kv_width()) / p_.cp, 2);
    charge(OpCategory::Attention, whole_sequence_attention(causal, false));
    ulysses(double(d.q_width()) / p_.cp, 1);
  } else if (p_.ring) {
    const double chunk = S / (2 * p_.cp);
    const double blocks = causal / d_.attention_block_fwd.at(chunk) + 4 * p_.cp * d_.launch_seconds;
    charge(OpCategory::Attention, blocks);
    // Merges: the fp32 accumulator read and written once per ring step.
    mem(OpCategory::Attention, p_.cp * T * double(d.q_width()) * (8 + c_), d_.copy_bw);
    const double step_bytes = 2 * T * double(d.kv_width()) * c_;
    const double comm = (p_.cp - 1) * send_recv(step_bytes, cp_group_);
    overlapped_comm(comm, std::max(0.0, comm - blocks));  // each step's pass behind its blocks
  } else {
    charge(OpCategory::Attention, whole_sequence_attention(causal, false, head));
  }
  flop(causal);
}

void Model::attention_bwd(double T) {
  const ModelDims& d = p_.dims;
  const double B = p_.cfg.train.micro_batch_size, S = double(p_.cfg.data.seq_len);
  const double D = double(d.head_dim), Nq = double(d.heads);
  const double causal = 2.5 * 2 * B * S * S * Nq * D / p_.cp;
  if (p_.cp > 1 && !p_.ring) {
    ulysses(double(d.q_width()) / p_.cp, 1);
    charge(OpCategory::Attention, whole_sequence_attention(causal, true));
    ulysses(double(d.q_width()) / p_.cp, 1);
    ulysses(double(d.kv_width()) / p_.cp, 2);
  } else if (p_.ring) {
    const double chunk = S / (2 * p_.cp);
    const double blocks = causal / d_.attention_block_bwd.at(chunk) + 4 * p_.cp * d_.launch_seconds;
    charge(OpCategory::Attention, blocks);
    mem(OpCategory::Attention, p_.cp * T * double(d.kv_width()) * 2 * 8, d_.copy_bw);
    // K/V again, and the fp32 dK/dV sums one step behind; the final hop home is exposed.
    const double kv = send_recv(2 * T * double(d.kv_width()) * c_, cp_group_);
    const double sums = send_recv(2 * T * double(d.kv_width()) * 4, cp_group_);
    const double comm = (p_.cp - 1) * kv + p_.cp * sums;
    overlapped_comm(comm, std::max(0.0, comm - blocks - sums) + sums);
  } else {
    charge(OpCategory::Attention, whole_sequence_attention(causal, true));
  }
  flop(causal);
}

void Model::ffn(double T, double F, bool backward) {
  const double H = double(p_.dims.hidden);
  if (!backward) {
    gemm(T, 2 * F, H, Pass::Fwd);
    mem(OpCategory::Experts, op_bytes::swiglu(T, F, c_, false), d_.swiglu_bw);
    gemm(T, H, F, Pass::Fwd);
    return;
  }
  gemm(T, F, H, Pass::Dgrad);
  gemm(H, F, T, Pass::Wgrad);
  mem(OpCategory::Experts, op_bytes::swiglu(T, F, c_, true), d_.swiglu_bw);
  gemm(T, H, 2 * F, Pass::Dgrad);
  gemm(2 * F, H, T, Pass::Wgrad);
}

void Model::ffn_gate_up(double T, double F) {
  gemm(T, 2 * F, double(p_.dims.hidden), Pass::Fwd);
  mem(OpCategory::Experts, op_bytes::swiglu(T, F, c_, false), d_.swiglu_bw);
}

// Saved tensors in host memory, per micro-batch: a host layer's input x_j and kept attention go
// out while layers j and j+1 run forward (its stage is rewritten by x_{j+2}), and come back while
// the layer after it runs backward (layer j+1's, or the LM head's for the last layer); a copy
// longer than its window is exposed.
void Model::offload(std::vector<double>& fwd, std::vector<double>& bwd, double T) {
  const ActivationOptions& o = p_.activation_options;
  if (o.host_layers == 0 || p_.run.device == Device::CPU) return;
  const ModelDims& d = p_.dims;
  const int L = int(d.layers);
  double total = 0, exposed = 0;
  for (int j = 0; j < o.host_layers; ++j) {
    if (!runs(j + 1)) continue;  // another pipeline stage's layer
    double bytes = T * double(d.hidden) * c_;
    const double kept = j < o.keep_attention ? T : double(o.keep_attention_tail * o.attention_tile);
    bytes += kept * (double(d.q_width()) * c_ + double(d.heads) * 4);
    const double out = bytes / l_.d2h, in = bytes / l_.h2d;
    const size_t out_end = size_t(j + 2 <= L ? j + 2 : j + 1),
                 in_seg = size_t(j + 1 < L ? j + 2 : L + 1);
    const double out_window = fwd[size_t(j + 1)] + (j + 2 <= L ? fwd[size_t(j + 2)] : 0);
    const double in_window = bwd[in_seg];
    total += out + in;
    // What a copy takes past its window holds up the segment that ends the window.
    set(kAttention, Phase::Backward);
    const double late_out = std::max(0.0, out - out_window),
                 late_in = std::max(0.0, in - in_window);
    fwd[out_end] += charge(OpCategory::Other, late_out);
    bwd[in_seg] += charge(OpCategory::Other, late_in);
    exposed += late_out + late_in;
  }
  st_.offload_copies += total * repeat_;
  st_.offload_exposed += exposed * repeat_;
}

// The routed experts and their exchange: dispatch → experts → combine, in chunks.
void Model::experts(double T, bool backward) {
  const ModelDims& d = p_.dims;
  const double H = double(d.hidden), F = double(d.expert_ffn), K = double(d.top_k);
  const double rows = T * K;  // balanced routing: every rank receives as many rows as it sends
  // A bounded exchange taking r rounds runs the grouped GEMMs r times on a round's rows each.
  const double rounds = p_.ep > 1 ? double(std::max(1, p_.exchange_rounds)) : 1.0;
  const double call = chunk(T) * K / rounds, chunks = T / chunk(T);  // a chunked block: per chunk
  double exchange = 0;
  double slowdown = 1;
  if (p_.ep > 1) {
    exchange = 2 * all_to_all(rows * H * c_, ep_group_);  // dispatch and combine
    if (p_.moe_chunks > 1) slowdown = l_.overlap_slowdown;
  }
  const double before = st_.seconds[size_t(OpCategory::Experts)];
  if (!backward) {
    grouped(rows, 2 * F, H, Pass::Fwd, slowdown, call);
    mem(OpCategory::Experts, op_bytes::swiglu(rows, F, c_, false), d_.swiglu_bw);
    grouped(rows, H, F, Pass::Fwd, slowdown, call);
  } else {
    if (rounds > 1) {  // only the last round's gate/up outputs are kept: the others again
      grouped(rows, 2 * F, H, Pass::Fwd, slowdown, call);
      mem(OpCategory::Experts, op_bytes::swiglu(rows, F, c_, false), d_.swiglu_bw);
    }
    grouped(rows, F, H, Pass::Dgrad, slowdown, call);
    grouped(rows, H, F, Pass::Wgrad, slowdown, call);
    mem(OpCategory::Experts, op_bytes::swiglu(rows, F, c_, true), d_.swiglu_bw);
    grouped(rows, H, 2 * F, Pass::Dgrad, slowdown, call);
    grouped(rows, 2 * F, H, Pass::Wgrad, slowdown, call);
  }
  if (p_.ep > 1) {
    const double experts_time = (st_.seconds[size_t(OpCategory::Experts)] - before) / repeat_;
    // Gathers into and out of expert-major order, and the counts' host all-to-all (forward).
    mem(OpCategory::RouterPermute, 2 * op_bytes::gather(rows, H, c_), d_.permute_bw);
    if (!backward) exposed_comm(chunks * (l_.node_latency + d_.sync_seconds));
    // Each further round is its own dispatch and combine: their latency and the round's counts.
    if (rounds > 1) exposed_comm((rounds - 1) * chunks * (l_.node_latency + d_.sync_seconds));
    const double c = std::min<double>(p_.moe_chunks, double(d.experts / p_.ep));
    const double exposed = exchange / c + std::max(0.0, exchange * (1 - 1 / c) - experts_time);
    overlapped_comm(exchange, exposed);
  }
}

void Model::moe_fwd(double T) {
  const ModelDims& d = p_.dims;
  const double H = double(d.hidden), E = double(d.experts), K = double(d.top_k);
  set(kRouter, phase_);
  gemm(T, E, H, Pass::Fwd);
  mem(OpCategory::RouterPermute, op_bytes::router(T, E, K), d_.router_bw);
  mem(OpCategory::RouterPermute, T * K * 16, d_.permute_bw);
  sync();  // the group sizes go to the host
  if (p_.cp > 1) exposed_comm(all_reduce(E * 4, cp_group_));
  mem(OpCategory::RouterPermute, T * E * 4, d_.router_bw);
  mem(OpCategory::RouterPermute, op_bytes::gather(T * K, H, c_), d_.permute_bw);
  // A chunked block's recompute stops at the router: its backward recomputes each chunk.
  if (phase_ == Phase::Recompute && chunked(T)) return;
  experts_fwd_chunks(T);
  set(kRouter, phase_);
  mem(OpCategory::RouterPermute, T * K * H * c_ + 2 * T * H * c_, d_.permute_bw);
  if (d.shared_ffn) {
    set(kDenseFfn, phase_);
    ffn(T, double(d.shared_ffn), false);
  }
}

// The experts' forward; a chunked block plans each chunk's route (its group sizes to the host).
void Model::experts_fwd_chunks(double T) {
  const ModelDims& d = p_.dims;
  if (chunked(T)) {
    set(kRouter, phase_);
    for (double i = 0; i < T / chunk(T); ++i) sync();
    mem(OpCategory::RouterPermute, T * double(d.top_k) * 16, d_.permute_bw);
  }
  set(kExperts, phase_);
  experts(T, false);
}

void Model::moe_bwd(double T) {
  const ModelDims& d = p_.dims;
  const double H = double(d.hidden), E = double(d.experts), K = double(d.top_k);
  if (chunked(T)) {  // each chunk's experts again: gather, experts, and the combine's inputs
    set(kRouter, phase_);
    mem(OpCategory::RouterPermute, op_bytes::gather(T * K, H, c_), d_.permute_bw);
    experts_fwd_chunks(T);
    if (d.shared_ffn) {
      set(kDenseFfn, phase_);
      ffn_gate_up(T, double(d.shared_ffn));
    }
  }
  set(kRouter, phase_);
  mem(OpCategory::RouterPermute, 2 * T * K * H * c_ + T * H * c_, d_.permute_bw);
  set(kExperts, phase_);
  experts(T, true);
  set(kRouter, phase_);
  mem(OpCategory::RouterPermute, T * K * H * c_ + T * H * c_, d_.permute_bw);
  mem(OpCategory::RouterPermute, T * E * 12 + T * K * 12, d_.router_bw);
  mem(OpCategory::Other, T * E * (4 + c_), d_.copy_bw);
  gemm(T, H, E, Pass::Dgrad);
  gemm(E, H, T, Pass::Wgrad);
  if (d.shared_ffn) {
    set(kDenseFfn, phase_);
    ffn(T, double(d.shared_ffn), true);
  }
}

void Model::layer_fwd(int l, double T) {
  const ModelDims& d = p_.dims;
  const double H = double(d.hidden), Q = double(d.q_width()), KV = double(d.kv_width());
  set(kAttention, phase_);
  norm(T, H, false);
  gemm(T, Q, H, Pass::Fwd);
  gemm(T, KV, H, Pass::Fwd);
  gemm(T, KV, H, Pass::Fwd);
  if (d.qk_norm) {
    norm(T * d.heads, double(d.head_dim), false);
    norm(T * d.kv_heads, double(d.head_dim), false);
  } else {
    mem(OpCategory::Other, 2 * T * (Q + KV) * c_, d_.copy_bw);
  }
  mem(OpCategory::Attention, op_bytes::rope(T, Q, c_), d_.rope_bw);
  mem(OpCategory::Attention, op_bytes::rope(T, KV, c_), d_.rope_bw);
  // A layer that keeps its attention output does not recompute it; one that keeps the last tiles
  // of it recomputes the tiles before them.
  const ActivationOptions& o = p_.activation_options;
  if (phase_ != Phase::Recompute)
    attention_fwd(T);
  else if (l >= o.keep_attention)
    attention_fwd(T, 1 - double(o.keep_attention_tail * o.attention_tile) / double(p_.cfg.data.seq_len));
  mem(OpCategory::Other, 2 * T * H * c_, d_.copy_bw);
  gemm(T, H, Q, Pass::Fwd);
  norm(T, H, false);
  if (phase_ == Phase::Recompute && chunked(T) && !d.is_moe(l)) return;
  mem(OpCategory::Other, 2 * T * H * c_, d_.copy_bw);
  if (d.is_moe(l)) {
    moe_fwd(T);
  } else {
    set(kDenseFfn, phase_);
    ffn(T, double(d.dense_ffn), false);
  }
}

void Model::layer_bwd(int l, double T) {
  const ModelDims& d = p_.dims;
  const double H = double(d.hidden), Q = double(d.q_width()), KV = double(d.kv_width());
  if (d.is_moe(l)) {
    moe_bwd(T);
  } else {
    set(kDenseFfn, phase_);
    mem(OpCategory::Other, T * H * c_, d_.copy_bw);
    if (chunked(T)) ffn_gate_up(T, double(d.dense_ffn));  // each chunk's gate/up again
    ffn(T, double(d.dense_ffn), true);
  }
  set(kAttention, phase_);
  norm(T, H, true);
  gemm(T, Q, H, Pass::Dgrad);
  gemm(H, Q, T, Pass::Wgrad);
  attention_bwd(T);
  mem(OpCategory::Attention, op_bytes::rope(T, Q + KV, c_), d_.rope_bw);
  if (d.qk_norm) {
    if (p_.activations.qk_raw_recomputed) {  // the norms' inputs projected again
      gemm(T, Q, H, Pass::Fwd);
      gemm(T, KV, H, Pass::Fwd);
    }
    norm(T * d.heads, double(d.head_dim), true);
    norm(T * d.kv_heads, double(d.head_dim), true);
  }
  gemm(T, H, Q, Pass::Dgrad);
  gemm(T, H, KV, Pass::Dgrad);
  gemm(T, H, KV, Pass::Dgrad);
  gemm(Q, H, T, Pass::Wgrad);
  gemm(KV, H, T, Pass::Wgrad);
  gemm(KV, H, T, Pass::Wgrad);
  norm(T, H, true);
}

// The optimizer's device work: Σg² per parameter (a segment's early where the program takes its
// norms at grad-norms), the norms to the host, AdamW (+ the cast) on the device-held state —
// master, m, v read and written, the gradient read, the compute weights written — per segment
// where the program updates segment by segment (device-update); ZeRO's broadcasts of every weight
// from its owner, on the compute stream.
void Model::optimizer(const StepProgram& program, WalkCosts& w) {
  set(kOptimizer, Phase::Backward);
  const ModelLayout& local = p_.local_layout();
  const int rank = rank_, segments = num_segments(p_.dims);
  std::vector<double> norm_bytes(size_t(segments), 0), native(size_t(segments), 0);
  std::vector<int> norm_params(size_t(segments), 0), launches(size_t(segments), 0);
  for (size_t q = 0; q < local.params.size(); ++q) {
    const int64_t n = local.params[q].numel();
    const size_t seg = size_t(param_segment(local, int(q)));
    if (!runs(int(seg))) continue;  // another pipeline stage's
    // A sliced parameter's norm and update run on its slice.
    const double k = sliced(q) ? double(p_.parallel.slice_numel(int(q), n)) : double(n);
    norm_bytes[seg] += k * double(dtype_size(p_.run.grad)), ++norm_params[seg];
    const bool host = !p_.state_on_host.empty() && p_.state_on_host[q];
    if (p_.owns(rank, int(q)) && !host) native[seg] += k, ++launches[seg];
  }
  std::vector<bool> early(size_t(segments), false), per_segment(size_t(segments), false);
  for (const Action& a : program.gradients)
    if (a.kind == ActionKind::GradNorms) early[size_t(a.begin)] = true;
  for (const Action& a : program.apply)
    if (a.kind == ActionKind::DeviceUpdate) per_segment[size_t(a.begin)] = true;
  w.norms.assign(size_t(segments), 0), w.device_update.assign(size_t(segments), 0);
  double rest = 0;
  for (int s = 0; s < segments; ++s) {
    const double norm =
        norm_bytes[size_t(s)] / d_.reduce_bw + norm_params[size_t(s)] * d_.launch_seconds;
    const double adamw =
        op_bytes::adamw(native[size_t(s)], double(dtype_size(p_.run.grad)), c_) / d_.adamw_bw +
        launches[size_t(s)] * d_.launch_seconds;
    (early[size_t(s)] ? w.norms[size_t(s)] : rest) += charge(OpCategory::Optimizer, norm);
    (per_segment[size_t(s)] ? w.device_update[size_t(s)] : rest) +=
        charge(OpCategory::Optimizer, adamw);
  }
  w.optimizer = rest + charge(OpCategory::Optimizer, d_.sync_seconds);
  if (p_.parallel.zero1()) {
    double dense = 0, expert = 0;
    for (size_t q = 0; q < local.params.size(); ++q)
      if (runs(param_segment(local, int(q))))
        (p_.parallel.expert(int(q)) ? expert : dense) += double(local.params[q].numel()) * c_;
    w.broadcast = send_recv(dense, dense_group_) + send_recv(expert, edp_group_) +
                  local.params.size() * l_.node_latency;
    exposed_comm(w.broadcast);
  }
}

// The collectives and copies of the program's actions: per segment its gradients' sums (whole
// parameters) and copies to the host, per gather group (a segment's parameters; with a tied
// embedding, group S its own) its gathers and reduce-scatters (sliced parameters).
void Model::action_costs(WalkCosts& w) {
  const ModelLayout& local = p_.local_layout();
  const int segments = num_segments(p_.dims);
  const bool tied = local.lm_head == local.embedding, device = p_.run.device != Device::CPU;
  const double g = double(dtype_size(p_.run.grad));
  w.reduce.assign(size_t(segments), 0), w.stash.assign(size_t(segments), 0);
  w.fetch.assign(size_t(segments + 1), 0), w.to_host.assign(size_t(segments), 0);
  w.gather.assign(size_t(segments + 1), 0), w.reduce_scatter.assign(size_t(segments + 1), 0);
  HostUpdateCosts& h = w.host;
  h.elements.assign(size_t(segments), 0);
  double to_host = 0, to_device = 0;
  const int m = p_.micro_batches;
  // Bytes per segment or group and replica group (dense, experts): each priced as one collective.
  std::vector<std::array<double, 2>> gather(size_t(segments + 1), {0, 0}), scatter = gather,
                                                                           sums = gather;
  for (size_t q = 0; q < local.params.size(); ++q) {
    const int64_t n = local.params[q].numel();
    const int seg = param_segment(local, int(q)),
              group = tied && int(q) == local.embedding ? segments : seg;
    if (!runs(seg)) continue;  // another pipeline stage's
    const size_t e = p_.parallel.expert(int(q)) ? 1 : 0;
    const bool host = !p_.state_on_host.empty() && p_.state_on_host[q],
               owned = p_.owns(rank_, int(q));
    const double k = sliced(q) ? double(p_.parallel.slice_numel(int(q), n)) : double(n);
    if (sliced(q)) {
      gather[size_t(group)][e] += double(aligned_numel(n)) * c_;
      scatter[size_t(group)][e] += double(n) * g;
    } else {
      sums[size_t(seg)][e] += double(n) * g;
    }
    // Streamed: the fp32 running sums out after each micro-batch but the last, back before the
    // next.
    if (!sliced(q) && p_.grads_in_flight(int(q)) && device) {
      w.stash[size_t(seg)] += double(n) * g / l_.d2h;
      w.fetch[size_t(group)] += double(n) * g / l_.h2d;
      to_host += double(n) * g * (m - 1);
    }
    if (!host || !owned) continue;
    // The host update: the gradients reach the host once final (bf16; fp32 slices), the new
    // weights come back (bf16).
    h.elements[size_t(seg)] += k;
    const double bytes = sliced(q) ? 4 * k : 2 * double(n);
    if (device) w.to_host[size_t(seg)] += bytes / l_.d2h;
    to_host += bytes, to_device += 2 * k;
  }
  for (int i = 0; i <= segments; ++i) {
    w.gather[size_t(i)] = all_gather(gather[size_t(i)][0], dense_group_) +
                          all_gather(gather[size_t(i)][1], edp_group_);
    w.reduce_scatter[size_t(i)] = reduce_scatter(scatter[size_t(i)][0], dense_group_) +
                                  reduce_scatter(scatter[size_t(i)][1], edp_group_);
    if (i < segments)
      w.reduce[size_t(i)] =
          all_reduce(sums[size_t(i)][0], dense_group_) + all_reduce(sums[size_t(i)][1], edp_group_);
  }
  st_.grad_to_host = device ? to_host / l_.d2h : 0;
  st_.weights_to_device = device ? to_device / l_.h2d : 0;
  // Host memory is shared with the pinned copies: calibrate measured the engine's rate beside
  // copies running both ways at full speed (adamw_under_copies); the update's own uploads (2 bytes
  // per parameter it writes) take that share of the links, and slow it in proportion.
  const HostSpec& hs = p_.machine.host;
  auto slowed = [&](double rate) {
    if (!device || l_.both <= 0) return rate;
    const double share = std::min(1.0, 2.0 * rate / l_.both);
    return rate * (1.0 - (1.0 - hs.adamw_under_copies) * share);
  };
  h.overlap = p_.cfg.optim.overlap;
  h.rate_one = h.overlap ? slowed(hs.adamw_one_pass) : hs.adamw_one_pass;
  h.rate_weights = slowed(hs.adamw_weights_pass);
  h.rate_state = hs.adamw_state_pass;  // writes no weights: no uploads beside it
}

void Model::price_segments(WalkCosts& w) {
  for (int c = 0; c < kNumComp; ++c) st_.components.push_back({kCompNames[c]});
  const ModelDims& d = p_.dims;
  const double T = double(p_.cfg.train.micro_batch_size) * p_.local_seq;
  const double H = double(d.hidden), V = double(d.vocab);
  const double chunk = std::min(double(p_.cfg.train.lm_head_chunk), T);
  const int segments = num_segments(d);
  const int m = p_.micro_batches;

  // One micro-batch, segment by segment, forward then backward (priced once, counted m times).
  repeat_ = m;
  std::vector<double>&fwd = w.forward, &bwd = w.backward;
  fwd.assign(size_t(segments), 0), bwd.assign(size_t(segments), 0);
  // Segment s's forward or backward priced into `into[s]`, if this rank runs it (every segment
  // without a pipeline).
  auto timed = [&](std::vector<double>& into, int s, auto&& fn) {
    if (!runs(s)) return;
    const double before = st_.compute() + st_.seconds[size_t(OpCategory::Communication)];
    fn();
    into[size_t(s)] += (st_.compute() + st_.seconds[size_t(OpCategory::Communication)] - before) / repeat_;
  };
  timed(fwd, 0, [&] {
    set(kEmbedding, Phase::Forward);
    mem(OpCategory::Other, 3 * T * 4, d_.copy_bw);  // the micro-batch's ids, targets, positions
    sync();
    mem(OpCategory::Other, op_bytes::embedding(T, H, c_, false), d_.embedding_bw);
  });
  for (int l = 0; l < d.layers; ++l)
    timed(fwd, l + 1, [&] {
      phase_ = Phase::Forward;
      layer_fwd(l, T);
    });
  timed(fwd, segments - 1, [&] {
    set(kLmHead, Phase::Forward);
    norm(T, H, false);
    // The training forward computes each chunk's logits once and from them dx and dW as well
    // (lmhead_ce_fwd_bwd): the three passes `mop calibrate` times as the LM head's backward.
    const double f = 6 * T * V * H;
    charge(OpCategory::Loss, f / d_.lm_head_bwd.at(chunk) + 2 * d_.launch_seconds);
    flop(f);
  });
  timed(bwd, segments - 1, [&] {
    set(kLmHead, Phase::Backward);
    norm(T, H, true);
  });
  for (int l = int(d.layers) - 1; l >= 0; --l)
    timed(bwd, l + 1, [&] {
      if (p_.cfg.train.recompute) {
        phase_ = Phase::Recompute;
        layer_fwd(l, T);
      }
      phase_ = Phase::Backward;
      layer_bwd(l, T);
    });
  timed(bwd, 0, [&] {
    set(kEmbedding, Phase::Backward);
    mem(OpCategory::Other, op_bytes::embedding(T, H, c_, true), d_.embedding_bw);
  });
  offload(fwd, bwd, T);
}

StepProgram Model::price(WalkCosts& w) {
  price_segments(w);
  const double T = double(p_.cfg.train.micro_batch_size) * p_.local_seq, H = double(p_.dims.hidden);
  // Once per step: zero the gradients the device keeps, read the losses; the optimizer.
  repeat_ = 1;
  set(kOptimizer, Phase::Backward);
  w.zero_grads =
      charge(OpCategory::Other, double(p_.memory.grads) / d_.copy_bw + d_.launch_seconds);
  w.read_losses = charge(OpCategory::Other, d_.sync_seconds);
  StepProgram program = make_step_program(p_, rank_);
  optimizer(program, w);
  action_costs(w);
  // Pipeline stages: one micro-batch's hidden state (or its gradient) to the neighbouring stage.
  w.message = send_recv(T * H * c_, neighbour_);
  return program;
}

// The program against the streams' clocks; what the compute stream waited for is charged here.
StepTime Model::finish(const WalkResult& r) {
  set(kGathers, Phase::Forward);
  overlapped_comm(r.gather_total, r.gathers);
  set(kGradSums, Phase::Backward);
  overlapped_comm(r.sums_total, r.sums + r.comm_on_compute);
  charge(OpCategory::Communication, r.slots);
  charge(OpCategory::Other, r.fetch);
  st_.grad_drain_exposed = r.slots;
  st_.host_update = r.host_update, st_.host_state = r.host_state, st_.host_two_pass = r.two_pass;
  st_.host_exposed = r.host;
  // Pipeline stages: the compute stream waiting for a neighbour's message or for the other stages
  // at the losses (the bubble) — timed as communication by the schedule, as the receives are.
  st_.pipeline_bubble = r.pipeline + r.losses_wait;
  st_.pipeline_messages = r.messages_total;
  charge(OpCategory::Communication, st_.pipeline_bubble);
  double total = 0;
  for (double s : st_.seconds) total += s;
  st_.step = total + st_.host_exposed;
  return st_;
}

}  // namespace

double attention_seconds(const DeviceSpec& d, double flops, double batch, double seq, int64_t tile,
                         double q_width, double kv_width, double c_bytes, bool backward) {
  const RateTable& causal = backward ? d.attention_bwd : d.attention_fwd;
  const RateTable& block = backward ? d.attention_block_bwd : d.attention_block_fwd;
  if (!TiledAttention::tiled(tile, int64_t(seq)) || int64_t(seq) % tile != 0)
    return flops / causal.at(seq) + d.launch_seconds;
  const double c = double(tile), n = seq / c, blocks = batch * n * (n + 1) / 2;
  // A tile's causal block holds 1/n of a sequence's causal FLOPs (c²/2 of S²/2), the n(n−1)/2
  // full blocks the rest.
  double s = flops / n / causal.at(c) + flops * (n - 1) / n / block.at(c) + blocks * d.launch_seconds;
  // Per block of c query rows, in acc (4-byte) elements of q_width or kv_width per row.
  const double a = 4, rows = c;
  double bytes;
  if (!backward) {  // a merge (acc and lse read and written, the block's output read), tile copies
    bytes = (blocks - batch) * rows * q_width * (2 * a + c_bytes) + batch * (n - 1) * rows * q_width * (a + c_bytes);
  } else {  // dq, dk, dv: converted to acc and added (the first dq block copied); sums copied out
    const double add = c_bytes + a + 3 * a;
    bytes = blocks * rows * (q_width + 2 * kv_width) * add + batch * n * rows * q_width * 2 * (a + c_bytes) +
            batch * seq * kv_width * 2 * (a + a + c_bytes);
  }
  s += bytes / d.copy_bw;
  return s;
}

std::vector<double> segment_seconds(const Plan& plan) {
  Plan whole = plan;
  whole.pp = 1;  // every segment
  Model m(whole, 0);
  WalkCosts w;
  m.price_segments(w);
  std::vector<double> t(w.forward.size());
  for (size_t s = 0; s < t.size(); ++s) t[s] = w.forward[s] + w.backward[s];
  return t;
}

StepTime predict_step_time(const Plan& plan, int rank) {
  MOP_CHECK(rank < plan.world, "rank ", rank, " of ", plan.world);
  if (plan.pp == 1) return Model(plan, plan.memory_rank).run();
  // Pipeline stages: one rank of each (the memory rank's position in its stage, or `rank`'s), walked
  // together; the step is the slowest stage's (or rank's stage's), reported with that stage's split.
  const int position = (rank >= 0 ? rank : plan.memory_rank) % plan.stage_size();
  const int stage = rank >= 0 ? plan.stage_of(rank) : -1;
  std::vector<std::unique_ptr<Model>> models;
  std::vector<StepProgram> programs;
  std::vector<WalkCosts> costs(size_t(plan.pp));
  for (int k = 0; k < plan.pp; ++k) {
    models.push_back(std::make_unique<Model>(plan, k * plan.stage_size() + position));
    programs.push_back(models.back()->price(costs[size_t(k)]));
  }
  const std::vector<WalkResult> walked = walk_pipeline(programs, costs);
  StepTime slowest;
  for (int k = 0; k < plan.pp; ++k) {
    StepTime t = models[size_t(k)]->finish(walked[size_t(k)]);
    t.stage = k;
    if (k == stage) return t;
    if (k == 0 || t.step > slowest.step) slowest = std::move(t);
  }
  return slowest;
}

}  // namespace mop
