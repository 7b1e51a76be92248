// The machine a plan is made for: its compute device (rates of the ops the step runs, memory),
// its host (memory, cores, the CPU AdamW's rates), and its links (pinned copies, collectives in a
// node and across nodes). Every rate is data: built-in descriptions of an H200 node and of the
// CPU backend, `mop calibrate` measures the machine it runs on, and a YAML machine file
// (`--machine FILE`, written by calibrate or by hand) describes hardware that is not here.
//
// Rates that depend on a size are tables of (size, rate) points, interpolated linearly in
// log(size) and held constant past the ends.
#pragma once

#include <array>
#include <string>
#include <utility>
#include <vector>

#include "core/tensor.h"

namespace mop {

struct RateTable {
  std::vector<std::pair<double, double>> points;  // (size, rate), sizes increasing
  double at(double size) const;
  bool empty() const { return points.empty(); }
};

struct DeviceSpec {
  Device kind = Device::CUDA;
  std::string name;
  double memory_bytes = 0;   // usable by one rank (after the runtime's own context)
  double reserve_bytes = 0;  // kept free: allocator slack, plans built lazily
  double peak_flops = 0;     // the MFU denominator (dense bf16 Tensor Core peak)
  // Dense GEMM (FLOP/s) by the GEMM's FLOPs (2·M·N·K): forward (y = x·Wᵀ), data gradient
  // (dx = dy·W), weight gradient (dW += dyᵀ·x, fp32 accumulation).
  RateTable gemm_fwd, gemm_dgrad, gemm_wgrad;
  // Grouped expert GEMM (FLOP/s) by rows per expert, measured at grouped_shape's K → N.
  RateTable grouped_fwd, grouped_dgrad, grouped_wgrad;
  std::string grouped_shape;  // e.g. "E=32 K=2048 N=1536": what the tables were measured on
  // A factor on those rates by the experts one call holds (a rank's local experts), 1 at
  // grouped_shape's E; empty: 1 throughout.
  RateTable grouped_experts;
  // Attention (FLOP/s, heads × 128) by sequence length: causal forward / backward, and the
  // non-causal blocks of ring attention.
  RateTable attention_fwd, attention_bwd, attention_block_fwd, attention_block_bwd;
  // The fused LM head + loss (FLOP/s) by its chunk of tokens (train.lm_head_chunk).
  RateTable lm_head_fwd, lm_head_bwd;
  // Memory-bound ops: effective bytes/s (read + written) of each family.
  double copy_bw = 0, norm_bw = 0, rope_bw = 0, swiglu_bw = 0, permute_bw = 0, router_bw = 0,
         embedding_bw = 0, adamw_bw = 0, reduce_bw = 0;
  double launch_seconds = 0;  // per op launched
  double sync_seconds = 0;    // a host round trip (small device → host copies)
  // Backend workspaces: base + per token of a micro-batch (besides the LM head's chunk buffer,
  // chunk × vocab bf16, which the plan adds itself).
  double workspace_bytes = 0, workspace_bytes_per_token = 0;
  double comm_buffer_bytes = 0;  // per asynchronous device communicator (NCCL)
  // In-step factors: what a whole step's compute stream measured over what these rates predicted,
  // per category of the step's time split (ops/timed_ops.h's OpCategory order; communication's
  // unused). Isolated kernels run at other clocks, caches and neighbours than a step's (and with
  // the device update overlapped, its time lands in the forward's categories): `mop calibrate
  // --step CONFIG` runs a step and writes them. 1: the isolated rates hold.
  std::array<double, 8> in_step{1, 1, 1, 1, 1, 1, 1, 1};
};

struct HostSpec {
  double memory_bytes = 0;  // per node
  int cores = 1;            // per node
  double pinned_fraction = 0.9;  // of memory_bytes that pinned allocations may take
  // The host AdamW (parameters/s with every core of the rank): one pass, and the two passes of an
  // overlapped update (weights first, then the state).
  double adamw_one_pass = 0, adamw_weights_pass = 0, adamw_state_pass = 0;
  double adamw_under_copies = 1;  // factor on those rates while pinned copies run both ways
  double dram_bw = 0;             // host memory bytes/s
};

struct LinkSpec {
  double h2d = 0, d2h = 0, both = 0;  // pinned host ↔ device bytes/s, each way and both at once
  // Collectives, bus bandwidth as nccl-tests defines it (bytes/s), and per-call latency, inside a
  // node and across nodes.
  double node_all_reduce = 0, node_all_to_all = 0, node_send_recv = 0, node_latency = 0;
  double net_all_reduce = 0, net_all_to_all = 0, net_send_recv = 0, net_latency = 0;
  // Compute kernels run slower by this factor while collectives share the device with them.
  double overlap_slowdown = 1;
};

struct Machine {
  std::string name;
  std::string base;    // the built-in description it starts from: h100, h200 or cpu
  std::string origin;  // where its rates come from, for the plan's report
  int gpus_per_node = 1;  // ranks per node (device kind cpu: processes per node)
  int nodes = 1;
  DeviceSpec device;
  HostSpec host;
  LinkSpec link;

  int ranks() const { return gpus_per_node * nodes; }
};

// Built-in descriptions: "h200" (one node of 8 H200s, from measurements on the H200 machine),
// "h100" (one node of 8 H100 SXM 80 GB, its device rates measured on an H100) and "cpu" (the CPU
// backend on a small development VM). Other names are a UserError.
Machine builtin_machine(const std::string& name);

// The built-in description of a GPU by its product name (as the CUDA runtime reports it): h100 for
// an H100, h200 for an H200, else h200 standing in. `note` (may be null) is set, for the log, where
// the description is not that card's own: another H100 variant than the SXM 80 GB one, or an
// unknown GPU (and how to measure it).
std::string builtin_for_gpu(const std::string& gpu_name, std::string* note);
// The built-in h200 node's host as `ranks_per_node` ranks on `cores` of its cores see it (each
// rank's AdamW rates by its cores and its share of the node's memory bandwidth): what a plan on
// this machine, or on a node with fewer ranks than eight, describes. Other machines' rates are
// their files' (measured by `mop calibrate` as they run).
void share_builtin_host(Machine& m, int cores, int ranks_per_node);
// A machine file: YAML as machine_yaml() writes it. Missing keys keep the built-in values of the
// file's `base` (default h200); unknown keys and bad values are a UserError naming them.
Machine load_machine(const std::string& path);
Machine parse_machine(const std::string& yaml_text, const std::string& origin);
std::string machine_yaml(const Machine& m);

}  // namespace mop
