// Plan search and the fit check: plans that overflow a rank's memory are rejected with the class
// that overflows, every plan kept fits and they come fastest first, keys the config sets are never
// changed, and a config that cannot fit is one UserError naming the class and what to change.
// Also the machine file: written and read back unchanged, bad files refused with the key named,
// and rate tables interpolated in log(size).
#include <algorithm>
#include <cmath>

#include "catch.h"
#include "test_util.h"
#include "config/config.h"
#include "plan/machine.h"
#include "plan/search.h"

using namespace mop;

namespace {

constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;

// q3moe-8l's geometry at 16K tokens: 5.6B parameters, ~100 GiB of weights, gradients and state.
Config q3(const std::string& extra = "") {
  return load_config_text(test::merge_yaml(R"(
model: {vocab_size: 151936, hidden_size: 2048, num_layers: 8, num_heads: 32, num_kv_heads: 4, head_dim: 128}
moe: {num_experts: 128, top_k: 8, expert_ffn: 768}
data: {seq_len: 16384}
train: {global_batch_size: 2, micro_batch_size: 1, device: cuda}
)", extra));
}

}  // namespace

TEST_CASE("plan search: what does not fit is rejected with its class, the rest ranked", "[cpu][plan]") {
  Machine m = builtin_machine("h200");
  m.device.memory_bytes = 80 * kGiB;  // an 80 GB GPU: all state on it cannot fit
  m.gpus_per_node = 2;
  const SearchResult r = search_plans(q3(), m, 2);
  REQUIRE(!r.feasible.empty());
  REQUIRE(!r.rejected.empty());
  for (const Candidate& c : r.feasible) {
    INFO(c.settings);
    CHECK(double(c.plan.memory.device_total()) <= m.device.memory_bytes);
    CHECK(c.plan.time.step > 0);
  }
  // Fastest first; of plans equally fast, the one that takes less device memory.
  for (size_t i = 1; i < r.feasible.size(); ++i) {
    const Plan &a = r.feasible[i - 1].plan, &b = r.feasible[i].plan;
    CHECK(a.time.step <= b.time.step);
    if (a.time.step == b.time.step) CHECK(a.memory.device_total() <= b.memory.device_total());
  }
  // Keeping every optimizer state on the GPU, unsharded, overflows it.
  int gpu_state = 0;
  for (const Candidate& c : r.rejected)
    if (c.cfg.optim.state_placement == "gpu" && c.cfg.parallel.moe.ep == 1 && !c.cfg.parallel.zero) {
      ++gpu_state;
      CHECK(c.group == "cuda memory: optimizer state");
      CHECK(c.why.find("optim.state_placement") != std::string::npos);
    }
  CHECK(gpu_state > 0);
  for (const Candidate& c : r.feasible)
    CHECK(!(c.cfg.optim.state_placement == "gpu" && c.cfg.parallel.moe.ep == 1 && !c.cfg.parallel.zero));
  // The open keys include the foldings and the placement; nothing the config set is among them.
  CHECK(std::find(r.open_keys.begin(), r.open_keys.end(), "parallel.moe.ep") != r.open_keys.end());
  CHECK(std::find(r.open_keys.begin(), r.open_keys.end(), "train.micro_batch_size") == r.open_keys.end());
  for (const Candidate& c : r.feasible) CHECK(c.cfg.train.micro_batch_size == 1);
}

TEST_CASE("plan search: pinned keys stay, invalid foldings are rejected as such", "[cpu][plan]") {
  Machine m = builtin_machine("h200");
  const SearchResult pinned = search_plans(
      q3("\nparallel: {attention: {cp: 2}}\ntrain: {global_batch_size: 4, micro_batch_size: 1, device: cuda}"), m, 8);
  REQUIRE(!pinned.feasible.empty());
  for (const Candidate& c : pinned.feasible) {
    CHECK(c.cfg.parallel.attention.cp == 2);
    CHECK(c.cfg.parallel.attention.dp == 4);
  }
  // 2 sequences per step cannot spread over 4 or 8 data-parallel ranks; cp 4 × dp 2 or cp 8 can.
  const SearchResult r = search_plans(q3(), m, 8);
  REQUIRE(!r.feasible.empty());
  for (const Candidate& c : r.feasible) CHECK(c.cfg.parallel.attention.dp <= 2);
  bool invalid = false;
  for (const Candidate& c : r.rejected)
    invalid = invalid || (c.group == "invalid settings" && c.why.find("train.global_batch_size") != std::string::npos);
  CHECK(invalid);
}

TEST_CASE("plan search: where nothing fits, the nearest world and batch sizes that do", "[cpu][plan]") {
  // 8 sequences over 12 ranks: no data-parallel size of 12 divides the batch where cp divides the
  // sequence, so nothing fits; 8 ranks and 16 (two nodes) do, and so do batches of 9 and 6.
  Config c = q3("data: {seq_len: 4096}\ntrain: {global_batch_size: 8}");
  c.pinned.erase("train.micro_batch_size");
  const Machine node = builtin_machine("h200");
  auto machine_for = [&](int w) {
    Machine m = node;
    m.nodes = (w + 7) / 8, m.gpus_per_node = std::min(8, w);
    return m;
  };
  REQUIRE(search_plans(c, machine_for(12), 12).feasible.empty());
  const FitAdvice a = fit_advice(c, 12, 8, /*batch=*/true, machine_for);
  CHECK(a.fewer == 8);
  CHECK(a.more == 16);
  CHECK(a.batch_below == 6);
  CHECK(a.batch_above == 9);
  // Without the batch in question, no batch sizes are tried.
  const FitAdvice b = fit_advice(c, 12, 8, /*batch=*/false, machine_for);
  CHECK((b.batch_below == 0 && b.batch_above == 0));
}

TEST_CASE("plan: a plan that cannot fit is one error naming the class and the settings", "[cpu][plan]") {
  Machine m = builtin_machine("h200");
  // 128K tokens without recompute: the activations alone exceed the GPU.
  const Config cfg = q3("\ndata: {seq_len: 131072}\ntrain: {global_batch_size: 1, micro_batch_size: 1, device: cuda}");
  try {
    make_plan(cfg, m, 1);
    FAIL("expected a UserError");
  } catch (const UserError& e) {
    const std::string what = e.what();
    CHECK(what.find("activations") != std::string::npos);
    CHECK(what.find("train.recompute: true") != std::string::npos);
    CHECK(what.find("parallel.attention.cp") != std::string::npos);
  }
  // The same with recompute fits (state placed on the host as needed).
  const Plan p = make_plan(q3("\ndata: {seq_len: 131072}\ntrain: {global_batch_size: 1, micro_batch_size: 1, "
                              "device: cuda, recompute: true}"), m, 1);
  CHECK(double(p.memory.device_total()) <= m.device.memory_bytes);
  // Host memory: all state on the host of a node whose host is too small.
  Machine small = m;
  small.host.memory_bytes = 16 * kGiB;
  try {
    make_plan(q3("\noptim: {state_placement: host}"), small, 1);
    FAIL("expected a UserError");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("host memory") != std::string::npos);
  }
}

TEST_CASE("plan: auto placement keeps state on the device while it fits, in forward order", "[cpu][plan]") {
  Machine m = builtin_machine("h200");
  const Plan fits = make_plan(q3("\ndata: {seq_len: 4096}\ntrain: {global_batch_size: 8, device: cuda}"), m, 1);
  CHECK(fits.host_params == 0);
  m.device.memory_bytes = 90 * kGiB;
  const Plan part = make_plan(q3(), m, 1);
  REQUIRE(part.host_params > 0);
  // The first segments (embedding, early layers) stay on the GPU; once one goes to the host, all
  // later ones do.
  const auto& s = part.segment_on_host;
  CHECK_FALSE(s.front());
  CHECK(s.back());
  CHECK(std::is_sorted(s.begin(), s.end()));
  CHECK(double(part.memory.device_total()) <= m.device.memory_bytes - m.device.reserve_bytes);
}

TEST_CASE("machine file: written and read back unchanged; bad files refused", "[cpu][plan]") {
  for (const char* name : {"h200", "h100", "cpu"}) {
    const Machine a = builtin_machine(name);
    const Machine b = parse_machine(machine_yaml(a), "m.yaml");
    CHECK(machine_yaml(b) == machine_yaml(a));
    CHECK(b.base == name);
    CHECK(b.origin.find("machine file m.yaml") == 0);
    CHECK(a.origin.find(std::string("built-in ") + name) == 0);
    CHECK(b.device.kind == a.device.kind);
    CHECK(b.device.gemm_fwd.points.size() == a.device.gemm_fwd.points.size());
  }
  // A few keys over a base: the rest stays the base's.
  const Machine c = parse_machine("base: h200\nnodes: 12\ndevice: {memory_gib: 80}\nhost: {memory_gib: 2048}\n", "x.yaml");
  CHECK(c.nodes == 12);
  CHECK(c.device.memory_bytes == 80 * kGiB);
  CHECK(c.host.memory_bytes == 2048 * kGiB);
  CHECK(c.link.h2d == builtin_machine("h200").link.h2d);
  auto refused = [](const std::string& text, const std::string& expect) {
    INFO(text);
    try {
      parse_machine(text, "bad.yaml");
      FAIL("expected a UserError");
    } catch (const UserError& e) {
      CHECK(std::string(e.what()).find(expect) != std::string::npos);
    }
  };
  refused("device: {memroy_gib: 80}\n", "bad.yaml:1: device.memroy_gib: unknown key");
  refused("device: {memory_gib: lots}\n", "device.memory_gib: expected a non-negative number, got 'lots'");
  refused("device: {gemm_fwd_tflops: [[100, 5], [10, 6]]}\n", "sizes must increase");
  refused("device: {kind: tpu}\n", "expected cuda or cpu");
  refused("base: a100\n", "machine 'a100' is not built in");
  refused("nodes: 0\n", "nodes: expected a positive integer");
  refused("[1, 2]\n", "a machine file is a mapping");
  refused("device: {memory_gib: 0}\n", "device.memory_gib must be positive");
}

TEST_CASE("machine: a GPU's built-in description by its name; another card's rates never silently", "[cpu][plan]") {
  std::string note;
  CHECK(builtin_for_gpu("NVIDIA H100 80GB HBM3", &note) == "h100");
  CHECK(note.empty());
  CHECK(builtin_for_gpu("NVIDIA H200", &note) == "h200");
  CHECK(note.empty());
  // Another H100 than the SXM 80 GB: the h100 description, said so.
  CHECK(builtin_for_gpu("NVIDIA H100 PCIe", &note) == "h100");
  CHECK(note.find("NVIDIA H100 PCIe") != std::string::npos);
  CHECK(note.find("mop calibrate") != std::string::npos);
  // An unknown GPU: the h200 stands in, and the note says so and how to measure it.
  CHECK(builtin_for_gpu("NVIDIA A100-SXM4-80GB", &note) == "h200");
  CHECK(note.find("no built-in description of the GPU 'NVIDIA A100-SXM4-80GB'") != std::string::npos);
  CHECK(note.find("mop calibrate") != std::string::npos);
  CHECK(builtin_for_gpu("NVIDIA H100 80GB HBM3", nullptr) == "h100");
  // Grace Hopper is not an H200, and the H200's PCIe card not the SXM one: each said so.
  CHECK(builtin_for_gpu("NVIDIA GH200 480GB", &note) == "h200");
  CHECK(note.find("no built-in description of the GPU 'NVIDIA GH200 480GB'") != std::string::npos);
  CHECK(builtin_for_gpu("NVIDIA H200 NVL", &note) == "h200");
  CHECK(note.find("NVIDIA H200 NVL") != std::string::npos);
  // The H100's own rates: the same Tensor Core peak, less memory and bandwidth than the H200's.
  const Machine h100 = builtin_machine("h100"), h200 = builtin_machine("h200");
  CHECK(h100.device.name == "NVIDIA H100 80GB HBM3");
  CHECK(h100.device.peak_flops == h200.device.peak_flops);
  CHECK(h100.device.memory_bytes < 80 * kGiB);
  CHECK(h100.device.copy_bw < h200.device.copy_bw);
  CHECK(h100.gpus_per_node == 8);
  // The checked-in machine files of the H100 load, on their base.
  for (const char* f : {"h100-1gpu", "h100-1-node", "h100-12-nodes"}) {
    INFO(f);
    const Machine m = load_machine(std::string(MOP_SOURCE_DIR) + "/configs/machines/" + f + ".yaml");
    CHECK(m.base == "h100");
    CHECK(m.device.name == "NVIDIA H100 80GB HBM3");
  }
}

TEST_CASE("machine: rate tables interpolate in log(size) and hold past the ends", "[cpu][plan]") {
  const RateTable t{{{100, 10}, {10000, 30}}};
  CHECK(t.at(1) == 10);
  CHECK(t.at(100) == 10);
  CHECK(t.at(1000) == Approx(20));  // halfway in log(size)
  CHECK(t.at(10000) == 30);
  CHECK(t.at(1e9) == 30);
}
