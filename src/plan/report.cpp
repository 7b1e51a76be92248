// Plan reports (see report.h): a plan as text and JSON, the search's ranked table, a step program.
#include "plan/report.h"

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdio>
#include <map>
#include <set>

#include "core/format.h"

#include "model/params.h"
#include "model/tiled_attention.h"
#include "runtime/memory.h"

namespace mop {

namespace {

std::string printf_str(const char* fmt, double a, double b = 0, double c = 0) {
  char buf[128];
  std::snprintf(buf, sizeof buf, fmt, a, b, c);
  return buf;
}

std::string ms(double seconds) { return grouped(1e3 * seconds) + " ms"; }
std::string gib(double bytes) { return format_bytes(bytes); }

// Characters on the screen: UTF-8 continuation bytes take none.
size_t display_width(const std::string& s) {
  size_t n = 0;
  for (unsigned char c : s) n += (c & 0xC0) != 0x80;
  return n;
}

// The parameters of each report component: where their weights, gradients and state live.
enum Comp { kEmbedding, kAttention, kRouter, kExperts, kDenseFfn, kLmHead, kNumComp };

int param_component(const ParamDef& p) {
  switch (p.kind) {
    case ParamKind::Embedding: return kEmbedding;
    case ParamKind::AttentionProj: return kAttention;
    case ParamKind::Norm: return p.layer < 0 ? kLmHead : kAttention;
    case ParamKind::Router: return kRouter;
    case ParamKind::Experts: return kExperts;
    case ParamKind::Ffn: return kDenseFfn;
    case ParamKind::LmHead: return kLmHead;
  }
  return kAttention;
}

struct CompMemory {
  double device = 0, host = 0;
};

// Device and host memory per component: parameters (weights, gradients, the state that lives
// there) plus the component's activations.
// The weights and gradients of the segments in flight (sliced: gathered; streamed or sliced:
// gradients) are shared by every component: `in_flight` gets them.
std::vector<CompMemory> component_memory(const Plan& p, double* in_flight = nullptr) {
  std::vector<CompMemory> out(kNumComp);
  const ModelLayout& local = p.local_layout();
  const double cw = double(dtype_size(p.run.compute)), gw = double(dtype_size(p.run.grad));
  double own = 0;
  for (size_t q = 0; q < local.params.size(); ++q) {
    const int64_t numel = local.params[q].numel();
    const double n = double(aligned_numel(numel));
    const bool sliced = p.parallel.params[q].kind == Sharding::Slice;
    const double k = sliced ? double(aligned_numel(p.parallel.slice_numel(int(q), numel))) : n;
    const bool host = !p.state_on_host.empty() && p.state_on_host[q];
    CompMemory& c = out[size_t(param_component(local.params[q]))];
    double wg = k * cw + (p.grads_in_flight(int(q)) ? 0 : n * gw) + (sliced && !host ? k * gw : 0);
    c.device += wg, own += wg;
    const double state = double(p.state_numel(p.memory_rank, int(q), numel));
    if (state == 0) continue;
    (host ? c.host : c.device) += 12 * state;
    if (!host || p.run.device == Device::CPU) continue;
    if (sliced || p.grads_in_flight(int(q))) c.host += (4 + cw) * state;
    else c.device += 2 * n, c.host += 4 * n;
  }
  if (in_flight) *in_flight = double(p.memory.weights + p.memory.grads) - own;
  const auto act = p.memory.activations_by_component;
  out[kAttention].device += double(act[size_t(Component::Attention)]);
  out[kRouter].device += double(act[size_t(Component::Router)]);
  out[kExperts].device += double(act[size_t(Component::Experts)]);
  out[kDenseFfn].device += double(act[size_t(Component::DenseFfn)]);
  out[kLmHead].device += double(act[size_t(Component::LmHead)]);
  return out;
}

std::string placement_of(const Plan& p, int comp) {
  const ModelDims& d = p.dims;
  switch (comp) {
    case kEmbedding: return std::string(p.parallel.sliced() ? "sliced" : "replicated") + " (" + std::to_string(d.vocab) + " × " + std::to_string(d.hidden) + ")";
    case kAttention: {
      std::string s = std::to_string(d.heads) + "/" + std::to_string(d.kv_heads) + " heads × " +
                      std::to_string(d.head_dim);
      const int64_t tile = p.activation_options.attention_tile;
      const std::string tiles = TiledAttention::tiled(tile, p.cfg.data.seq_len)
                                    ? ", query tiles of " + std::to_string(tile)
                                    : std::string();
      if (p.cp == 1) return s + ", whole sequences" + tiles;
      return s + ", cp " + std::to_string(p.cp) + (p.ring ? " ring" : " Ulysses") + ", " +
             std::to_string(p.local_seq) + " tokens per rank" + tiles;
    }
    case kRouter: return std::to_string(d.experts) + " experts, top " + std::to_string(d.top_k);
    case kExperts:
      return "ep " + std::to_string(p.ep) + ": " + std::to_string(d.experts / p.ep) + " per rank" +
             (p.ep > 1 ? ", exchange in " + std::to_string(p.moe_chunks) + " chunk(s)" : std::string());
    case kDenseFfn:
      return d.first_dense || d.shared_ffn ? std::to_string(d.first_dense) + " dense layer(s)" +
                                                 (d.shared_ffn ? ", shared expert" : "")
                                           : "none";
    case kLmHead:
      return std::string(d.tied ? "tied" : "untied") + ", fused with the loss, " +
             std::to_string(std::min<int64_t>(p.cfg.train.lm_head_chunk,
                                              p.cfg.train.micro_batch_size * p.local_seq)) +
             "-token chunks";
  }
  return "";
}

// The techniques this plan uses, as `mop plan` names them.
std::vector<std::pair<Plan::Technique, std::string>> technique_names(const Plan& p) {
  std::vector<std::pair<Plan::Technique, std::string>> out;
  if (p.parallel.sliced()) out.push_back({Plan::Technique::Slice, "slicing"});
  if (p.stream_grads) out.push_back({Plan::Technique::StreamGrads, "streaming the gradients"});
  if (p.ep > 1 && p.cfg.parallel.moe.exchange_budget > 0)
    out.push_back({Plan::Technique::ExchangeBudget, "the exchange budget"});
  return out;
}

}  // namespace

std::string plan_text(const Plan& p) {
  std::string o;
  const Machine& m = p.machine;
  const bool gpu = p.run.device != Device::CPU;
  o += "plan: " + std::to_string(p.world) + " rank(s) on " + m.name + " (" + m.device.name + ", " +
       gib(m.device.memory_bytes) + " per rank; host " + gib(m.host.memory_bytes) + " per node, " +
       std::to_string(m.gpus_per_node) + " rank(s) per node, " + std::to_string(m.nodes) + " node(s))\n";
  if (!m.origin.empty()) o += "  machine description: " + m.origin + "\n";
  for (const std::string& n : p.notes) o += "  " + n + "\n";
  o += "  batch: " + std::to_string(p.cfg.train.global_batch_size) + " sequences × " +
       std::to_string(p.cfg.data.seq_len) + " tokens per step; " + std::to_string(p.micro_batches) +
       " micro-batch(es) of " + std::to_string(p.cfg.train.micro_batch_size) + " per rank; recompute " +
       (p.cfg.train.recompute ? "on" : "off") + (p.parallel.zero1() ? "; ZeRO-1" : "") + "\n";
  o += "  parameters " + std::string(p.parallel.sliced() ? "sliced" : "whole") + " (parallel.shard: " +
       p.cfg.parallel.shard + "); gradients of host-updated segments " +
       (p.stream_grads ? "streamed" : p.parallel.sliced() ? "sliced (whole ones in flight, slices on the GPU)" : "kept until final") + " (optim.gradients: " + p.cfg.optim.gradients +
       "); expert exchange " +
       (p.ep > 1 && p.cfg.parallel.moe.exchange_budget > 0
            ? printf_str("bounded (parallel.moe.exchange_budget: %g, %.0f round(s))", p.cfg.parallel.moe.exchange_budget,
                         p.exchange_rounds)
            : std::string("for the worst case (parallel.moe.exchange_budget: 0)")) + "\n";
  {
    // What each technique saves this plan's device memory: the same plan with it switched off.
    std::string saved;
    for (const auto& [t, name] : technique_names(p)) {
      // A technique can cost memory here (streaming with no more host segments than in flight).
      const double without = double(p.memory_without(t).device_total());
      const double diff = without - double(p.memory.device_total());
      saved += std::string(saved.empty() ? "" : "; ") + name + (diff < 0 ? " costs " : " saves ") +
               gib(std::abs(diff)) + " (" + gib(without) + " without)";
    }
    if (!saved.empty()) o += "  device memory per rank: " + saved + "\n";
  }
  o += "\n";

  double in_flight = 0;
  const std::vector<CompMemory> mem = component_memory(p, &in_flight);
  char line[320];
  std::snprintf(line, sizeof line, "%-16s %-50s %11s %11s %9s %9s %9s %14s\n", "component", "placement",
                gpu ? "GPU mem" : "memory", "host mem", "forward", "backward", "recompute",
                "comm (exposed)");
  o += line;
  auto row = [&](const char* name, const std::string& place, double dev, double host,
                 const ComponentTime* t) {
    std::string comm = t && t->comm_total > 0 ? ms(t->comm_total) + " (" + ms(t->comm_exposed) + ")" : "-";
    std::snprintf(line, sizeof line, "%-16s %-50s %11s %11s %9s %9s %9s %14s\n", name, place.c_str(),
                  dev > 0 ? gib(dev).c_str() : "-", host > 0 ? gib(host).c_str() : "-",
                  t ? ms(t->forward).c_str() : "-", t ? ms(t->backward).c_str() : "-",
                  t && t->recompute > 0 ? ms(t->recompute).c_str() : "-", comm.c_str());
    o += line;
  };
  const char* names[kNumComp] = {"embedding", "attention", "router", "experts", "dense FFN", "LM head + loss"};
  for (int c = 0; c < kNumComp; ++c) {
    if (c == kDenseFfn && !p.dims.first_dense && !p.dims.shared_ffn) continue;
    row(names[c], placement_of(p, c), mem[size_t(c)].device, mem[size_t(c)].host, &p.time.components[size_t(c)]);
  }
  int host_segments = 0;
  for (bool h : p.segment_on_host) host_segments += h;
  const ComponentTime& opt = p.time.of(StepComponent::Optimizer);
  std::string state = host_segments == 0 ? std::string(gpu ? "all on the GPU" : "all with the CPU backend")
                                         : std::to_string(host_segments) + "/" +
                                               std::to_string(p.segment_on_host.size()) + " segments in host memory" +
                                               (p.time.host_two_pass ? ", two passes" : "");
  row("optimizer", state, 0, 0, &opt);
  const ActivationOptions& ao = p.activation_options;
  std::string saved = "kept with every activation";
  if (ao.recompute) {
    saved = ao.host_layers ? std::to_string(ao.host_layers) + "/" + std::to_string(p.dims.layers) + " on the host"
                           : std::string("on the GPU");
    if (ao.keep_attention) saved += "; " + std::to_string(ao.keep_attention) + " keep attention";
    if (ao.keep_attention_tail) saved += "; tails of " + std::to_string(ao.keep_attention_tail) + " tiles";
    saved += "; rest recomputed";
  }
  row("layer inputs", saved, double(p.memory.activations_by_component[size_t(Component::Checkpoints)]),
      ao.host_layers ? double(p.activations.host_arena_bytes()) : 0, nullptr);
  row("act. gradients", "shared by the layers",
      double(p.memory.activations_by_component[size_t(Component::Gradients)]), 0, nullptr);
  if (p.parallel.sliced() || in_flight > 0)
    row("weight gathers", p.parallel.sliced() ? "sliced weights gathered, 2 segments in flight"
                                              : "gradients of 2 segments in flight",
        in_flight, 0, p.parallel.sliced() ? &p.time.of(StepComponent::Gathers) : nullptr);
  if (p.world > 1) row("gradient sums", p.cfg.parallel.overlap_grad_reduce ? "per segment, own stream" : "in turn",
                       0, 0, &p.time.of(StepComponent::GradSums));

  const MemoryPlan& mp = p.memory;
  o += "\nmemory of rank " + std::to_string(p.memory_rank) + (gpu ? " (GPU)" : "") + ": weights " +
       gib(double(mp.weights)) + ", gradients " + gib(double(mp.grads)) + ", optimizer state " +
       gib(double(mp.optimizer_state)) + ", gradient staging " + gib(double(mp.host_grad_staging)) +
       ", activations " + gib(double(mp.activations)) + ", workspaces " + gib(double(mp.workspaces)) +
       ", batch " + gib(double(mp.batch)) + ", communicators " + gib(double(mp.comms)) + " = " +
       gib(double(mp.device_total())) + " of " + gib(m.device.memory_bytes) +
       printf_str(" (%.0f%%)\n", 100.0 * double(mp.device_total()) / m.device.memory_bytes);
  o += "host memory per rank: optimizer state " + gib(double(mp.host_optimizer_state)) + ", staging " +
       gib(double(mp.host_staging)) + ", mirrors " + gib(double(mp.host_activations)) + " = " +
       gib(double(mp.host_total())) + " (× " + std::to_string(std::min(p.world, m.gpus_per_node)) +
       " per node of " + gib(m.host.memory_bytes) + ")\n";

  const StepTime& t = p.time;
  OpTimes split;
  split.seconds = t.seconds;
  o += "\ntime per step (predicted): " + split.describe() + "\n";
  if (p.pp > 1)
    o += "  pipeline stage " + std::to_string(t.stage) + " of " + std::to_string(p.pp) +
         " (the slowest; the table and the split above are its): waiting for the neighbouring stages and at the "
         "losses " + ms(t.pipeline_bubble) + " (the bubble, in communication), messages " +
         ms(t.pipeline_messages) + " on their own stream; the component table's memory is the whole model's\n";
  if (t.comm_total > 0)
    o += "  collectives " + ms(t.comm_total) + " in all, " + ms(t.seconds[size_t(OpCategory::Communication)]) +
         " exposed\n";
  if (t.offload_copies > 0)
    o += "  saved tensors to the host and back " + ms(t.offload_copies) + ", " + ms(t.offload_exposed) +
         " exposed\n";
  if (p.host_params > 0)
    o += "  host update " + ms(t.host_update) + " until the new weights" +
         (t.host_two_pass ? " + " + ms(t.host_state) + " state pass" : std::string()) + ", " +
         ms(t.host_exposed) + " exposed; gradients to the host " + ms(t.grad_to_host) +
         ", weights back " + ms(t.weights_to_device) + " (overlapped)\n";
  o += "  step " + ms(t.step) + " → " + grouped(t.tokens_per_second(p)) + " tokens/s (" +
       grouped(t.tokens_per_second(p) / p.world) + " per rank)" +
       printf_str(", model %.0f TFLOP/s per rank, MFU %.1f%%\n",
                  p.model_flops_per_step() / t.step / p.world / 1e12, 100 * t.mfu(p));
  return o;
}

Json plan_json(const Plan& p) {
  Json j = Json::object();
  j["machine"] = p.machine.name;
  j["ranks"] = p.world;
  Json notes = Json::array();
  for (const std::string& n : p.notes) notes.push_back(n);
  j["notes"] = notes;
  j["device"] = std::string(device_name(p.run.device));
  Json f = Json::object();
  f["cp"] = p.cp, f["dp"] = p.dp, f["ep"] = p.ep, f["edp"] = p.edp;
  f["attention"] = p.cp > 1 ? (p.ring ? "ring" : "ulysses") : "local";
  f["moe_chunks"] = p.moe_chunks;
  f["micro_batch_size"] = p.cfg.train.micro_batch_size;
  f["micro_batches"] = p.micro_batches;
  f["recompute"] = p.cfg.train.recompute;
  const int64_t tokens = int64_t(p.activation_options.max_batch) * p.activation_options.max_seq;
  f["moe_chunk_tokens"] = p.activation_options.chunk_tokens(tokens);
  f["keep_attention_layers"] = p.activation_options.keep_attention;
  f["keep_attention_tail_tiles"] = p.activation_options.keep_attention_tail;
  f["attention_tile"] = TiledAttention::tiled(p.activation_options.attention_tile, p.cfg.data.seq_len)
                            ? p.activation_options.attention_tile : 0;
  f["host_layers"] = p.activation_options.host_layers;
  f["zero"] = p.parallel.zero1();
  f["state_placement"] = p.cfg.optim.state_placement;
  f["shard"] = p.cfg.parallel.shard;
  f["sliced"] = p.parallel.sliced();
  f["gradients"] = p.cfg.optim.gradients;
  f["stream_grads"] = p.stream_grads;
  f["exchange_budget"] = p.cfg.parallel.moe.exchange_budget;
  f["exchange_rows"] = p.exchange_rows;
  f["exchange_rounds"] = p.exchange_rounds;
  Json seg = Json::array();
  for (bool h : p.segment_on_host) seg.push_back(h ? "host" : "device");
  f["segment_state"] = seg;
  j["plan"] = f;
  const MemoryPlan& m = p.memory;
  Json mem = Json::object();
  mem["rank"] = p.memory_rank;
  mem["weights"] = m.weights, mem["grads"] = m.grads, mem["optimizer_state"] = m.optimizer_state;
  mem["gradient_staging"] = m.host_grad_staging, mem["activations"] = m.activations;
  mem["workspaces"] = m.workspaces, mem["batch"] = m.batch, mem["comms"] = m.comms;
  mem["device_total"] = m.device_total(), mem["device_capacity"] = p.machine.device.memory_bytes;
  mem["host_optimizer_state"] = m.host_optimizer_state, mem["host_staging"] = m.host_staging;
  mem["host_activations"] = m.host_activations, mem["host_total"] = m.host_total();
  Json act = Json::object();
  for (int c = 0; c < kNumComponents; ++c) act[component_name(Component(c))] = m.activations_by_component[size_t(c)];
  mem["activations_by_component"] = act;
  // The device memory per rank were each technique the plan uses switched off, and the difference.
  Json saved = Json::object();
  for (const auto& [t, name] : technique_names(p)) {
    const size_t without = p.memory_without(t).device_total();
    Json x = Json::object();
    x["device_total_without"] = without;
    x["saved"] = int64_t(without) - int64_t(m.device_total());
    saved[t == Plan::Technique::Slice ? "shard_slice" : t == Plan::Technique::StreamGrads ? "stream_grads"
                                                                                           : "exchange_budget"] = x;
  }
  mem["techniques"] = saved;
  j["memory"] = mem;
  const StepTime& t = p.time;
  Json time = Json::object();
  Json cats = Json::object();
  for (int c = 0; c < kNumOpCategories; ++c) cats[op_category_name(OpCategory(c))] = t.seconds[size_t(c)];
  time["categories"] = cats;
  Json comps = Json::array();
  for (const ComponentTime& c : t.components) {
    Json x = Json::object();
    x["name"] = c.name, x["forward"] = c.forward, x["backward"] = c.backward;
    x["recompute"] = c.recompute, x["comm_total"] = c.comm_total, x["comm_exposed"] = c.comm_exposed;
    x["flops"] = c.flops;
    comps.push_back(x);
  }
  time["components"] = comps;
  time["host_update"] = t.host_update, time["host_state"] = t.host_state;
  time["host_exposed"] = t.host_exposed, time["host_two_pass"] = t.host_two_pass;
  time["offload_copies"] = t.offload_copies, time["offload_exposed"] = t.offload_exposed;
  time["comm_total"] = t.comm_total;
  time["step"] = t.step;
  time["tokens_per_second"] = t.tokens_per_second(p);
  time["mfu"] = t.mfu(p);
  j["time"] = time;
  return j;
}

std::string search_text(const SearchResult& r, int top) {
  std::string o;
  o += "searched " + grouped(double(r.feasible.size() + r.rejected.size())) + " plans over";
  for (const std::string& k : r.open_keys) o += " " + k;
  o += ": " + grouped(double(r.feasible.size())) + " fit, " + grouped(double(r.rejected.size())) + " do not\n\n";
  // The columns as wide as their widest cell, so that they line up whatever the settings.
  const int shown = std::min<int>(top, int(r.feasible.size()));
  std::vector<std::array<std::string, 7>> rows;
  rows.push_back({"#", "settings", "step", "tokens/s", "MFU", "device mem", "host mem"});
  for (int i = 0; i < shown; ++i) {
    const Candidate& c = r.feasible[size_t(i)];
    const Plan& p = c.plan;
    rows.push_back({std::to_string(i + 1), c.settings, ms(p.time.step), grouped(p.time.tokens_per_second(p)),
                    printf_str("%.1f%%", 100 * p.time.mfu(p)), gib(double(p.memory.device_total())),
                    gib(double(p.memory.host_total()))});
  }
  std::array<size_t, 7> width{};
  for (const auto& row : rows)
    for (size_t c = 0; c < row.size(); ++c) width[c] = std::max(width[c], display_width(row[c]));
  for (const auto& row : rows) {
    if (shown == 0) break;
    std::string line;
    for (size_t c = 0; c < row.size(); ++c) {
      // The settings to the left, the figures to the right.
      const std::string pad(width[c] - display_width(row[c]), ' ');
      line.append(c == 0 ? 1 : 2, ' ');
      line += c == 1 ? row[c] + pad : pad + row[c];
    }
    o += line + "\n";
  }
  if (!r.rejected.empty()) {
    std::map<std::string, std::vector<const Candidate*>> groups;
    for (const Candidate& c : r.rejected) groups[c.group].push_back(&c);
    o += "\nrejected:\n";
    for (const auto& [key, list] : groups) {
      o += "  " + grouped(double(list.size())) + " × " + (key.find("memory") != std::string::npos
                                                            ? "do not fit in " + key
                                                            : key) + "\n";
      // A few examples, each with a reason of its own.
      std::set<std::string> told;
      for (size_t i = 0; i < list.size() && told.size() < 3; ++i)
        if (told.insert(list[i]->why).second) o += "      " + list[i]->settings + ": " + list[i]->why + "\n";
    }
  }
  return o;
}

Json search_json(const SearchResult& r, int top) {
  Json j = Json::object();
  Json keys = Json::array();
  for (const std::string& k : r.open_keys) keys.push_back(k);
  j["open_keys"] = keys;
  Json fit = Json::array();
  for (int i = 0; i < int(r.feasible.size()) && i < top; ++i) {
    Json c = plan_json(r.feasible[size_t(i)].plan);
    c["settings"] = r.feasible[size_t(i)].settings;
    fit.push_back(c);
  }
  j["feasible"] = fit;
  j["feasible_count"] = r.feasible.size();
  Json rej = Json::array();
  for (const Candidate& c : r.rejected) {
    Json x = Json::object();
    x["settings"] = c.settings, x["why"] = c.why, x["group"] = c.group;
    rej.push_back(x);
  }
  j["rejected"] = rej;
  return j;
}

Json program_json(const StepProgram& program) {
  auto actions = [](const std::vector<Action>& list) {
    Json out = Json::array();
    for (const Action& a : list) {
      Json j = Json::object();
      j["action"] = action_name(a.kind);
      j["stream"] = stream_name(a.stream);
      if (a.begin >= 0) {
        Json seg = Json::array();
        seg.push_back(a.begin), seg.push_back(a.end);
        j["segments"] = seg;
      }
      if (a.micro_batch >= 0) j["micro_batch"] = a.micro_batch;
      out.push_back(j);
    }
    return out;
  };
  Json j = Json::object();
  j["segments"] = program.shape.segments;
  j["micro_batches"] = program.shape.micro_batches;
  j["gradients"] = actions(program.gradients);
  j["apply"] = actions(program.apply);
  return j;
}

}  // namespace mop
