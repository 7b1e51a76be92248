// Machine descriptions (see machine.h): the built-in ones, and the YAML machine file. One table
// of fields (path, unit, where the value lives) serves parsing, validation and writing, so the
// file format is the table. Units are in the key names: *_gib (2^30 bytes), *_gbps (10^9
// bytes/s), *_tflops (10^12 FLOP/s), *_gparams (10^9 parameters/s), *_us (microseconds).
#include "plan/machine.h"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <functional>
#include <set>
#include <sstream>

#include "core/error.h"
#include "core/small_file.h"

namespace mop {

double RateTable::at(double size) const {
  MOP_CHECK(!points.empty(), "rate table without points");
  if (size <= points.front().first) return points.front().second;
  if (size >= points.back().first) return points.back().second;
  for (size_t i = 1; i < points.size(); ++i)
    if (size <= points[i].first) {
      const auto [x0, y0] = points[i - 1];
      const auto [x1, y1] = points[i];
      const double f = (std::log(size) - std::log(x0)) / (std::log(x1) - std::log(x0));
      return y0 + f * (y1 - y0);
    }
  return points.back().second;
}

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

enum class Kind { Number, Int, Text, Table, DeviceKind };

struct Field {
  const char* path;
  Kind kind;
  double unit;  // file value × unit = stored value (tables: the rates; sizes are plain)
  std::function<void*(Machine&)> at;
  const char* doc;
};

template <class T>
std::function<void*(Machine&)> member(T Machine::*section, double T::*field) {
  return [=](Machine& m) -> void* { return &(m.*section.*field); };
}
template <class T>
std::function<void*(Machine&)> table(T Machine::*section, RateTable T::*field) {
  return [=](Machine& m) -> void* { return &(m.*section.*field); };
}

const std::vector<Field>& fields() {
  using D = DeviceSpec;
  using H = HostSpec;
  using L = LinkSpec;
  auto dev = [](double D::*f) { return member(&Machine::device, f); };
  auto dtab = [](RateTable D::*f) { return table(&Machine::device, f); };
  auto host = [](double H::*f) { return member(&Machine::host, f); };
  auto link = [](double L::*f) { return member(&Machine::link, f); };
  auto in_step = [](size_t c) { return std::function<void*(Machine&)>([c](Machine& m) -> void* { return &m.device.in_step[c]; }); };
  static const std::vector<Field> f = {
      {"name", Kind::Text, 1, [](Machine& m) -> void* { return &m.name; }, "what this describes"},
      {"gpus_per_node", Kind::Int, 1, [](Machine& m) -> void* { return &m.gpus_per_node; }, "ranks per node"},
      {"nodes", Kind::Int, 1, [](Machine& m) -> void* { return &m.nodes; }, "nodes"},
      {"device.kind", Kind::DeviceKind, 1, [](Machine& m) -> void* { return &m.device.kind; }, "cuda or cpu"},
      {"device.name", Kind::Text, 1, [](Machine& m) -> void* { return &m.device.name; }, ""},
      {"device.memory_gib", Kind::Number, kGiB, dev(&D::memory_bytes), "usable by one rank"},
      {"device.reserve_gib", Kind::Number, kGiB, dev(&D::reserve_bytes), "kept free"},
      {"device.peak_tflops", Kind::Number, 1e12, dev(&D::peak_flops), "MFU denominator"},
      {"device.gemm_fwd_tflops", Kind::Table, 1e12, dtab(&D::gemm_fwd), "by GEMM FLOPs"},
      {"device.gemm_dgrad_tflops", Kind::Table, 1e12, dtab(&D::gemm_dgrad), "by GEMM FLOPs"},
      {"device.gemm_wgrad_tflops", Kind::Table, 1e12, dtab(&D::gemm_wgrad), "by GEMM FLOPs"},
      {"device.grouped_fwd_tflops", Kind::Table, 1e12, dtab(&D::grouped_fwd), "by rows per expert"},
      {"device.grouped_dgrad_tflops", Kind::Table, 1e12, dtab(&D::grouped_dgrad), "by rows per expert"},
      {"device.grouped_wgrad_tflops", Kind::Table, 1e12, dtab(&D::grouped_wgrad), "by rows per expert"},
      {"device.grouped_by_experts", Kind::Table, 1, dtab(&D::grouped_experts), "factor by local experts"},
      {"device.grouped_shape", Kind::Text, 1, [](Machine& m) -> void* { return &m.device.grouped_shape; }, ""},
      {"device.attention_fwd_tflops", Kind::Table, 1e12, dtab(&D::attention_fwd), "causal, by sequence"},
      {"device.attention_bwd_tflops", Kind::Table, 1e12, dtab(&D::attention_bwd), "causal, by sequence"},
      {"device.attention_block_fwd_tflops", Kind::Table, 1e12, dtab(&D::attention_block_fwd), "non-causal"},
      {"device.attention_block_bwd_tflops", Kind::Table, 1e12, dtab(&D::attention_block_bwd), "non-causal"},
      {"device.lm_head_fwd_tflops", Kind::Table, 1e12, dtab(&D::lm_head_fwd), "by chunk tokens"},
      {"device.lm_head_bwd_tflops", Kind::Table, 1e12, dtab(&D::lm_head_bwd), "by chunk tokens"},
      {"device.copy_gbps", Kind::Number, 1e9, dev(&D::copy_bw), ""},
      {"device.norm_gbps", Kind::Number, 1e9, dev(&D::norm_bw), ""},
      {"device.rope_gbps", Kind::Number, 1e9, dev(&D::rope_bw), ""},
      {"device.swiglu_gbps", Kind::Number, 1e9, dev(&D::swiglu_bw), ""},
      {"device.permute_gbps", Kind::Number, 1e9, dev(&D::permute_bw), ""},
      {"device.router_gbps", Kind::Number, 1e9, dev(&D::router_bw), ""},
      {"device.embedding_gbps", Kind::Number, 1e9, dev(&D::embedding_bw), ""},
      {"device.adamw_gbps", Kind::Number, 1e9, dev(&D::adamw_bw), ""},
      {"device.reduce_gbps", Kind::Number, 1e9, dev(&D::reduce_bw), ""},
      {"device.launch_us", Kind::Number, 1e-6, dev(&D::launch_seconds), ""},
      {"device.sync_us", Kind::Number, 1e-6, dev(&D::sync_seconds), ""},
      {"device.workspace_gib", Kind::Number, kGiB, dev(&D::workspace_bytes), ""},
      {"device.workspace_bytes_per_token", Kind::Number, 1, dev(&D::workspace_bytes_per_token), ""},
      {"device.comm_buffer_gib", Kind::Number, kGiB, dev(&D::comm_buffer_bytes), ""},
      {"device.in_step_attention", Kind::Number, 1, in_step(0), "step ÷ isolated rates (mop calibrate --step)"},
      {"device.in_step_dense_gemms", Kind::Number, 1, in_step(1), ""},
      {"device.in_step_experts", Kind::Number, 1, in_step(2), ""},
      {"device.in_step_router_permute", Kind::Number, 1, in_step(3), ""},
      {"device.in_step_lm_head", Kind::Number, 1, in_step(4), ""},
      {"device.in_step_optimizer", Kind::Number, 1, in_step(5), ""},
      {"device.in_step_other", Kind::Number, 1, in_step(7), ""},
      {"host.memory_gib", Kind::Number, kGiB, host(&H::memory_bytes), "per node"},
      {"host.cores", Kind::Int, 1, [](Machine& m) -> void* { return &m.host.cores; }, "per node"},
      {"host.pinned_fraction", Kind::Number, 1, host(&H::pinned_fraction), ""},
      {"host.adamw_one_pass_gparams", Kind::Number, 1e9, host(&H::adamw_one_pass), ""},
      {"host.adamw_weights_pass_gparams", Kind::Number, 1e9, host(&H::adamw_weights_pass), ""},
      {"host.adamw_state_pass_gparams", Kind::Number, 1e9, host(&H::adamw_state_pass), ""},
      {"host.adamw_under_copies", Kind::Number, 1, host(&H::adamw_under_copies), ""},
      {"host.dram_gbps", Kind::Number, 1e9, host(&H::dram_bw), ""},
      {"link.h2d_gbps", Kind::Number, 1e9, link(&L::h2d), ""},
      {"link.d2h_gbps", Kind::Number, 1e9, link(&L::d2h), ""},
      {"link.both_gbps", Kind::Number, 1e9, link(&L::both), ""},
      {"link.node_all_reduce_gbps", Kind::Number, 1e9, link(&L::node_all_reduce), ""},
      {"link.node_all_to_all_gbps", Kind::Number, 1e9, link(&L::node_all_to_all), ""},
      {"link.node_send_recv_gbps", Kind::Number, 1e9, link(&L::node_send_recv), ""},
      {"link.node_latency_us", Kind::Number, 1e-6, link(&L::node_latency), ""},
      {"link.net_all_reduce_gbps", Kind::Number, 1e9, link(&L::net_all_reduce), ""},
      {"link.net_all_to_all_gbps", Kind::Number, 1e9, link(&L::net_all_to_all), ""},
      {"link.net_send_recv_gbps", Kind::Number, 1e9, link(&L::net_send_recv), ""},
      {"link.net_latency_us", Kind::Number, 1e-6, link(&L::net_latency), ""},
      {"link.overlap_slowdown", Kind::Number, 1, link(&L::overlap_slowdown), ""},
  };
  return f;
}

RateTable tab(std::initializer_list<std::pair<double, double>> pts, double unit) {
  RateTable t;
  for (auto [x, y] : pts) t.points.push_back({x, y * unit});
  return t;
}

// One node of 8 H200s (141 GB HBM3e each, NVLink 4, one NDR 400 Gb/s NIC per GPU) with 2 TiB of
// host memory and 112 cores. The device and PCIe figures are what `mop calibrate` measured on one
// H200 of the H200 machine (docs/plan.md; the grouped expert GEMMs re-measured on
// 2026-12-01 with the CUTLASS sm90 kernels). Not measured here: the 8-GPU NVLink collectives
// (nccl-tests' published H100/H200 bus bandwidths), the network (90% of a 400 Gb/s link per GPU),
// and a full node's host: the AdamW rates of a rank are share_builtin_host's (8 ranks on 112
// cores: 0.4 of the slice we measured). The H200 machine's own figures:
// configs/machines/h200-1gpu.yaml.
Machine h200() {
  Machine m;
  m.name = "h200";
  m.base = "h200";
  m.origin = "built-in h200: one H200's rates as mop calibrate measured them (2026-12-01/04), the node's "
             "collectives from published nccl-tests figures, a DGX-class host";
  m.gpus_per_node = 8;
  m.nodes = 1;
  DeviceSpec& d = m.device;
  d.kind = Device::CUDA;
  d.name = "NVIDIA H200";
  d.memory_bytes = 139.29 * kGiB;
  d.reserve_bytes = 2 * kGiB;
  d.peak_flops = 989e12;
  d.gemm_fwd = tab({{2.68435e+08, 23}, {2.14748e+09, 184}, {1.71799e+10, 651}, {1.37439e+11, 767}, {1.09951e+12, 773}}, 1e12);
  d.gemm_dgrad = tab({{2.68435e+08, 24}, {2.14748e+09, 195}, {1.71799e+10, 655}, {1.37439e+11, 772}, {1.09951e+12, 691}}, 1e12);
  d.gemm_wgrad = tab({{2.68435e+08, 25}, {2.14748e+09, 194}, {1.71799e+10, 590}, {1.37439e+11, 707}, {1.09951e+12, 661}}, 1e12);
  d.grouped_fwd = tab({{64, 161}, {128, 317}, {256, 454}, {512, 542}, {1024, 626}, {2048, 658}}, 1e12);
  d.grouped_dgrad = tab({{64, 164}, {128, 324}, {256, 434}, {512, 545}, {1024, 642}, {2048, 634}}, 1e12);
  d.grouped_wgrad = tab({{64, 56}, {128, 107}, {256, 199}, {512, 328}, {1024, 455}, {2048, 505}}, 1e12);
  d.grouped_shape = "E=128 H=2048 F=768, gate/up and down";
  // By the local experts a call holds, at 1,024 rows each (2026-12-04, the same kernels).
  d.grouped_experts = tab({{4, 0.950}, {8, 1.046}, {16, 1.086}, {32, 1.150}, {64, 1.087}, {128, 1}}, 1);
  d.attention_fwd = tab({{1024, 268}, {4096, 541}, {16384, 665}, {65536, 609}, {131072, 572}}, 1e12);
  d.attention_bwd = tab({{1024, 189}, {4096, 438}, {16384, 547}, {65536, 543}, {131072, 531}}, 1e12);
  d.attention_block_fwd = tab({{1024, 520}, {4096, 675}, {16384, 697}, {32768, 664}}, 1e12);
  d.attention_block_bwd = tab({{1024, 360}, {4096, 558}, {16384, 557}, {32768, 545}}, 1e12);
  d.lm_head_fwd = tab({{1024, 609}, {4096, 629}}, 1e12);
  d.lm_head_bwd = tab({{1024, 573}, {4096, 635}}, 1e12);
  d.copy_bw = 4.20e12, d.norm_bw = 2.64e12, d.rope_bw = 3.87e12, d.swiglu_bw = 4.10e12;
  d.permute_bw = 4.55e12, d.router_bw = 0.763e12, d.embedding_bw = 1.44e12;
  d.adamw_bw = 4.01e12, d.reduce_bw = 4.20e12;
  d.launch_seconds = 4.7e-6;
  d.sync_seconds = 9.5e-6;
  d.workspace_bytes = 0.104 * kGiB;
  d.workspace_bytes_per_token = 32921;
  d.comm_buffer_bytes = 0.1 * kGiB;
  m.host.memory_bytes = 2048 * kGiB;
  m.host.pinned_fraction = 0.9;
  m.host.adamw_under_copies = 0.61;
  share_builtin_host(m, 112, 8);
  LinkSpec& l = m.link;
  l.h2d = 55.5e9, l.d2h = 55.3e9, l.both = 101.7e9;
  l.node_all_reduce = 450e9, l.node_all_to_all = 300e9, l.node_send_recv = 350e9;
  l.node_latency = 20e-6;
  l.net_all_reduce = 45e9, l.net_all_to_all = 40e9, l.net_send_recv = 45e9, l.net_latency = 30e-6;
  l.overlap_slowdown = 1.19;
  return m;
}

// One node of 8 H100 SXM 80 GB (HBM3, NVLink 4, one NDR 400 Gb/s NIC per GPU), a host like the
// h200 node's. The device and PCIe figures are what `mop calibrate` measured on one "NVIDIA H100
// 80GB HBM3" on 2026-12-08 (configs/machines/h100-1gpu.yaml, where that machine's own 16-core host
// is too); the same Tensor Core peak as the H200 with two thirds of its memory bandwidth. The
// collectives, the network and the host are the h200 node's (the same NVLink 4 and NICs; the
// host's AdamW rates by share_builtin_host). Not measured yet: the in-step factors
// (`mop calibrate --step`), which are 1 here.
Machine h100() {
  Machine m = h200();
  m.name = "h100";
  m.base = "h100";
  m.origin = "built-in h100: one H100 80GB HBM3's rates as mop calibrate measured them (2026-12-08), the "
             "node's collectives and host as the h200 node's";
  DeviceSpec& d = m.device;
  d.name = "NVIDIA H100 80GB HBM3";
  d.memory_bytes = 78.66 * kGiB;
  d.peak_flops = 989e12;
  d.gemm_fwd = tab({{2.68435e+08, 32}, {2.14748e+09, 255}, {1.71799e+10, 635}, {1.37439e+11, 682}, {1.09951e+12, 721}}, 1e12);
  d.gemm_dgrad = tab({{2.68435e+08, 32}, {2.14748e+09, 251}, {1.71799e+10, 619}, {1.37439e+11, 667}, {1.09951e+12, 725}}, 1e12);
  d.gemm_wgrad = tab({{2.68435e+08, 32}, {2.14748e+09, 235}, {1.71799e+10, 577}, {1.37439e+11, 614}, {1.09951e+12, 579}}, 1e12);
  d.grouped_fwd = tab({{64, 143}, {128, 265}, {256, 396}, {512, 469}, {1024, 564}, {2048, 573}}, 1e12);
  d.grouped_dgrad = tab({{64, 145}, {128, 270}, {256, 396}, {512, 478}, {1024, 550}, {2048, 577}}, 1e12);
  d.grouped_wgrad = tab({{64, 41}, {128, 75}, {256, 127}, {512, 230}, {1024, 282}, {2048, 320}}, 1e12);
  d.grouped_experts = tab({{4, 0.925}, {8, 1.026}, {16, 1.076}, {32, 1.106}, {64, 1.071}, {128, 1}}, 1);
  d.attention_fwd = tab({{1024, 280}, {4096, 488}, {16384, 618}, {65536, 637}, {131072, 590}}, 1e12);
  d.attention_bwd = tab({{1024, 179}, {4096, 404}, {16384, 538}, {65536, 550}, {131072, 543}}, 1e12);
  d.attention_block_fwd = tab({{1024, 522}, {4096, 627}, {16384, 644}, {32768, 644}, {65536, 590}, {131072, 619}}, 1e12);
  d.attention_block_bwd = tab({{1024, 341}, {4096, 501}, {16384, 560}, {32768, 569}, {65536, 564}, {131072, 558}}, 1e12);
  d.lm_head_fwd = tab({{1024, 516}, {4096, 552}}, 1e12);
  d.lm_head_bwd = tab({{1024, 490}, {4096, 567}}, 1e12);
  d.copy_bw = 2.99e12, d.norm_bw = 2.23e12, d.rope_bw = 2.87e12, d.swiglu_bw = 2.99e12;
  d.permute_bw = 3.24e12, d.router_bw = 0.763e12, d.embedding_bw = 1.15e12;
  d.adamw_bw = 2.92e12, d.reduce_bw = 2.21e12;
  d.launch_seconds = 5.2e-6;
  d.sync_seconds = 9.5e-6;
  m.link.h2d = 55.4e9, m.link.d2h = 55.3e9, m.link.both = 97.2e9;
  return m;
}

// The CPU backend (fp32, OpenMP) on this project's 2-core development VM, as `mop calibrate`
// measured it there.
Machine cpu() {
  Machine m;
  m.name = "cpu";
  m.base = "cpu";
  m.origin = "built-in cpu: the CPU backend on a 2-core development VM, as mop calibrate measured it";
  m.gpus_per_node = 1;
  m.nodes = 1;
  DeviceSpec& d = m.device;
  d.kind = Device::CPU;
  d.name = "CPU backend";
  d.memory_bytes = 22 * kGiB;
  d.reserve_bytes = 1 * kGiB;
  d.peak_flops = 80e9;
  d.gemm_fwd = tab({{65536, 9.4}, {524288, 26.4}, {4.1943e+06, 50.5}, {3.35544e+07, 80.0}}, 1e9);
  d.gemm_dgrad = tab({{65536, 29.3}, {524288, 79.2}, {4.1943e+06, 111.8}, {3.35544e+07, 133.2}}, 1e9);
  d.gemm_wgrad = tab({{65536, 12.1}, {524288, 46.8}, {4.1943e+06, 88.4}, {3.35544e+07, 108.9}}, 1e9);
  d.grouped_fwd = tab({{16, 7.3}, {64, 24.7}, {256, 57.4}}, 1e9);
  d.grouped_dgrad = tab({{16, 30.8}, {64, 70.3}, {256, 101.6}}, 1e9);
  d.grouped_wgrad = tab({{16, 16.4}, {64, 38.4}, {256, 58.5}}, 1e9);
  d.grouped_shape = "E=8 H=64 F=32, gate/up and down";
  d.attention_fwd = tab({{64, 22.9}, {256, 34.4}}, 1e9);
  d.attention_bwd = tab({{64, 26.7}, {256, 48.2}}, 1e9);
  d.attention_block_fwd = tab({{64, 30.6}, {256, 34.9}}, 1e9);
  d.attention_block_bwd = tab({{64, 41.3}, {256, 45.4}}, 1e9);
  d.lm_head_fwd = tab({{64, 28.2}}, 1e9);
  d.lm_head_bwd = tab({{64, 52.2}}, 1e9);
  d.copy_bw = 45e9, d.norm_bw = 17e9, d.rope_bw = 8.5e9, d.swiglu_bw = 8.3e9, d.permute_bw = 138e9;
  d.router_bw = 1.35e9, d.embedding_bw = 44e9, d.adamw_bw = 4.1e9, d.reduce_bw = 4.9e9;
  d.launch_seconds = 0;
  d.sync_seconds = 0;
  m.host = {23.5 * kGiB, 2, 0.9, 2.1e9, 2.3e9, 3.2e9, 1, 28e9};
  LinkSpec& l = m.link;
  l.h2d = l.d2h = l.both = 10e9;
  l.node_all_reduce = l.node_all_to_all = l.node_send_recv = 2e9;
  l.node_latency = 20e-6;
  l.net_all_reduce = l.net_all_to_all = l.net_send_recv = 1e9;
  l.net_latency = 50e-6;
  l.overlap_slowdown = 1;
  return m;
}

std::string fmt_number(double v) {
  char buf[40];
  std::snprintf(buf, sizeof buf, "%.6g", v);
  return buf;
}

void check_machine(const Machine& m, const std::string& origin) {
  auto need = [&](bool ok, const char* what) {
    MOP_USER_CHECK(ok, origin, ": ", what);
  };
  need(m.gpus_per_node >= 1 && m.nodes >= 1, "gpus_per_node and nodes must be at least 1");
  need(m.device.memory_bytes > 0, "device.memory_gib must be positive");
  need(m.host.memory_bytes > 0 && m.host.cores >= 1, "host.memory_gib and host.cores must be positive");
  need(m.host.pinned_fraction > 0 && m.host.pinned_fraction <= 1, "host.pinned_fraction must be in (0, 1]");
  need(m.link.overlap_slowdown >= 1, "link.overlap_slowdown must be at least 1");
  for (double f : m.device.in_step) need(f >= 0.05 && f <= 20, "device.in_step_* factors must be in [0.05, 20]");
}

}  // namespace

// The host AdamW of one rank is bound by its cores and by its share of the node's memory
// bandwidth. Measured on a 16-core slice of the H200 machine's host (~140 GB/s): 5.3 G params/s in
// one pass, 8.2 and 5.8 for the weights and state passes of two. A rank of `ranks` on `cores`
// cores of a node of ~450 GB/s (two sockets) runs at the slice's rates × min(its cores / 16, its
// bandwidth / 140 GB/s).
void share_builtin_host(Machine& m, int cores, int ranks_per_node) {
  constexpr double kSliceCores = 16, kSliceBw = 140e9, kNodeBw = 450e9;
  const int ranks = std::max(1, ranks_per_node);
  m.host.cores = std::max(1, cores);
  const double bw = kNodeBw / ranks;
  const double f = std::min(double(m.host.cores) / ranks / kSliceCores, bw / kSliceBw);
  m.host.adamw_one_pass = 5.3e9 * f;
  m.host.adamw_weights_pass = 8.2e9 * f;
  m.host.adamw_state_pass = 5.8e9 * f;
  m.host.dram_bw = std::min(bw, kSliceBw * double(m.host.cores) / ranks / kSliceCores);
}

Machine builtin_machine(const std::string& name) {
  if (name == "h200") return h200();
  if (name == "h100") return h100();
  if (name == "cpu") return cpu();
  throw_user_error("machine '", name, "' is not built in (h100, h200 or cpu); give a machine file");
}

std::string builtin_for_gpu(const std::string& gpu_name, std::string* note) {
  const auto has = [&](const char* part) { return gpu_name.find(part) != std::string::npos; };
  std::string why;
  std::string base = "h200";
  if (has("H200") && !has("GH200")) {
    base = "h200";
    if (has("NVL") || has("PCIe"))
      why = "the GPU is an " + gpu_name + ": the built-in h200 (SXM 141 GB) describes it";
  } else if (has("H100") && !has("GH100")) {
    base = "h100";
    if (!has("HBM3") && !has("SXM"))
      why = "the GPU is an " + gpu_name + ": the built-in h100 (SXM 80 GB, HBM3) describes it";
  } else {
    why = "no built-in description of the GPU '" + gpu_name + "': the h200's rates stand in";
  }
  if (!why.empty()) why += "; measure this machine with `mop calibrate --out FILE` and give it as train.machine or --machine";
  if (note) *note = why;
  return base;
}

Machine parse_machine(const std::string& text, const std::string& origin) {
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::ParserException& ex) {
    throw_user_error(origin, ":", ex.mark.line + 1, ": malformed YAML: ", ex.msg);
  }
  MOP_USER_CHECK(root.IsMap(), origin, ": a machine file is a mapping (name:, device:, host:, link:)");
  std::string base = "h200";
  if (root["base"]) {
    MOP_USER_CHECK(root["base"].IsScalar(), origin, ": base: expected h100, h200 or cpu");
    base = root["base"].Scalar();
  }
  Machine m = builtin_machine(base);
  m.origin = "machine file " + origin + " (what it leaves out: the built-in " + base + "'s)";
  std::set<std::string> seen;
  auto located = [&](const YAML::Node& n, const std::string& path) {
    return origin + (n.Mark().line >= 0 ? ":" + std::to_string(n.Mark().line + 1) : "") + ": " + path;
  };
  std::function<void(const YAML::Node&, const std::string&)> walk = [&](const YAML::Node& map,
                                                                        const std::string& prefix) {
    for (const auto& kv : map) {
      const std::string key = kv.first.Scalar();
      const std::string path = prefix.empty() ? key : prefix + "." + key;
      if (path == "base") continue;
      const Field* f = nullptr;
      for (const Field& c : fields())
        if (c.path == path) f = &c;
      if (!f) {
        const bool section = path == "device" || path == "host" || path == "link";
        MOP_USER_CHECK(section && kv.second.IsMap(), located(kv.first, path), ": unknown key");
        walk(kv.second, path);
        continue;
      }
      const std::string where = located(kv.second, path);
      void* p = f->at(m);
      auto number = [&](const YAML::Node& n) {
        MOP_USER_CHECK(n.IsScalar(), where, ": expected a number");
        char* end = nullptr;
        const double v = std::strtod(n.Scalar().c_str(), &end);
        MOP_USER_CHECK(end && *end == 0 && !n.Scalar().empty() && std::isfinite(v) && v >= 0, where,
                       ": expected a non-negative number, got '", n.Scalar(), "'");
        return v;
      };
      switch (f->kind) {
        case Kind::Number: *static_cast<double*>(p) = number(kv.second) * f->unit; break;
        case Kind::Int: {
          const double v = number(kv.second);
          MOP_USER_CHECK(v == std::floor(v) && v >= 1 && v <= 1 << 20, where, ": expected a positive integer");
          *static_cast<int*>(p) = int(v);
          break;
        }
        case Kind::Text:
          MOP_USER_CHECK(kv.second.IsScalar(), where, ": expected a string");
          *static_cast<std::string*>(p) = kv.second.Scalar();
          break;
        case Kind::DeviceKind: {
          MOP_USER_CHECK(kv.second.IsScalar() && (kv.second.Scalar() == "cuda" || kv.second.Scalar() == "cpu"),
                         where, ": expected cuda or cpu");
          *static_cast<Device*>(p) = kv.second.Scalar() == "cuda" ? Device::CUDA : Device::CPU;
          break;
        }
        case Kind::Table: {
          MOP_USER_CHECK(kv.second.IsSequence() && kv.second.size() > 0, where,
                         ": expected a list of [size, rate] pairs");
          RateTable t;
          for (const auto& pt : kv.second) {
            MOP_USER_CHECK(pt.IsSequence() && pt.size() == 2, where, ": expected [size, rate] pairs");
            const double x = number(pt[0]), y = number(pt[1]);
            MOP_USER_CHECK(x > 0 && y > 0, where, ": sizes and rates must be positive");
            MOP_USER_CHECK(t.points.empty() || x > t.points.back().first, where,
                           ": sizes must increase");
            t.points.push_back({x, y * f->unit});
          }
          *static_cast<RateTable*>(p) = std::move(t);
          break;
        }
      }
    }
  };
  walk(root, "");
  check_machine(m, origin);
  return m;
}

Machine load_machine(const std::string& path) {
  return parse_machine(read_small_file(path, "machine file", kConfigFileCap), path);
}

std::string machine_yaml(const Machine& m0) {
  Machine m = m0;
  std::ostringstream os;
  os << "# mop machine description (mop calibrate, or by hand; see docs/plan.md).\n";
  os << "base: " << (m.device.kind == Device::CPU ? "cpu" : m.base == "h100" ? "h100" : "h200") << "\n";
  std::string section;
  for (const Field& f : fields()) {
    std::string path = f.path, key = path;
    const size_t dot = path.find('.');
    std::string sec = dot == std::string::npos ? "" : path.substr(0, dot);
    if (dot != std::string::npos) key = path.substr(dot + 1);
    if (sec != section) {
      if (!sec.empty()) os << sec << ":\n";
      section = sec;
    }
    void* p = f.at(m);
    if (f.kind == Kind::Table && static_cast<RateTable*>(p)->empty())
      continue;  // absent: the base's
    os << (sec.empty() ? "" : "  ") << key << ": ";
    switch (f.kind) {
      case Kind::Number: os << fmt_number(*static_cast<double*>(p) / f.unit); break;
      case Kind::Int: os << *static_cast<int*>(p); break;
      case Kind::Text: os << '"' << *static_cast<std::string*>(p) << '"'; break;
      case Kind::DeviceKind: os << (*static_cast<Device*>(p) == Device::CUDA ? "cuda" : "cpu"); break;
      case Kind::Table: {
        os << "[";
        const RateTable& t = *static_cast<RateTable*>(p);
        for (size_t i = 0; i < t.points.size(); ++i)
          os << (i ? ", " : "") << "[" << fmt_number(t.points[i].first) << ", "
             << fmt_number(t.points[i].second / f.unit) << "]";
        os << "]";
        break;
      }
    }
    os << "\n";
  }
  return os.str();
}

}  // namespace mop
