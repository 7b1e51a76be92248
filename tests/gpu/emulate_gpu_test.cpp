// [gpu][emulate] The stand-in collectives on device buffers (`mop emulate` on a GPU): rank 0 and
// rank 3 of a 4-rank job (attention cp 2 × dp 2, experts ep 2 × dp 2; or two pipeline stages of
// attention dp 2 and experts ep 2, whose ranks 0 and 3 are the first and the last stage's, their
// messages stand-ins too), each emulated alone on the one GPU, allocate what their plan says in every memory class but the backends' workspaces,
// issue the collectives the same ranks issue emulated on the CPU backend (the same calls of the
// same groups at the same shapes: only the element type and which of a group's comms carries a
// call may differ, and the device agrees on its workspaces once more), and train two steps whose
// losses are finite (what the stand-ins "receive" is finite data).
#ifdef MOP_HAVE_CUDA

#include <spdlog/spdlog.h>

#include <cmath>
#include <cstdio>
#include <regex>

#include "catch.h"
#include "gpu/gpu_test_util.h"
#include "parallel/collective_log.h"
#include "parallel/routing_model.h"
#include "parallel/run_compare.h"
#include "parallel/standin_comm.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

struct Emulated {
  MemoryPlan allocated, planned;
  CollectiveLog log;
  std::vector<double> losses;
};

Emulated emulate(const std::string& yaml, int rank, int world) {
  auto job = std::make_shared<StandInJob>();
  job->rank = rank, job->size = world;
  const RoutingModel balanced = RoutingModel::parse("balanced", 8, 2);
  job->expert_counts = [balanced](int layer, int, int64_t rows, int64_t, int32_t* out) {
    balanced.counts(layer, rows / 2, out);
  };
  World w = standin_world(job, world);
  Emulated e;
  w.collective_log = &e.log;
  const Config cfg = load_config_text(yaml);
  Trainer t(cfg, w, run_machine(cfg, w));
  e.allocated = t.allocated_memory();
  e.planned = t.plan().memory_of_rank(rank);
  for (int s = 0; s < 2; ++s) e.losses.push_back(t.step_once().loss);
  return e;
}

// A log entry without its element types and comm kind: "ep(2) all_to_all_v [96,32] ← [96,32]".
std::string shape_only(const std::string& entry) {
  static const std::regex dtype("\\b(bf16|f16|f32|f64)\\["), kind("^(data|side|host) ");
  return std::regex_replace(std::regex_replace(entry, dtype, "["), kind, "");
}

}  // namespace

TEST_CASE("gpu emulate: a rank's stand-in collectives on the device allocate and call as planned",
          "[gpu][emulate]") {
  if (!test::gpu_available()) {
    std::fprintf(stderr, "no CUDA device: [gpu][emulate] case skipped\n");
    return;
  }
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 40000);
  const char* layouts[] = {"attention: {cp: 2, dp: 2}, moe: {ep: 2, dp: 2", "pp: 2, attention: {cp: 1, dp: 2}, moe: {ep: 2, dp: 1"};
  for (const char* layout : layouts)
  for (const char* placement : {"gpu", "host"}) {
    for (const int rank : {0, 3}) {
      INFO("state on " << placement << ", rank " << rank << " of 4, " << layout);
      auto yaml = [&](const char* device) {
        return test::compare_model_yaml(false, corpus) +
               "optim: {lr: 0.01, schedule: constant, warmup_steps: 0, state_placement: " +
               placement +
               "}\n"
               "train: {steps: 2, global_batch_size: 4, micro_batch_size: 1, eval_interval: 0, "
               "device: " +
               device +
               "}\nparallel: {" + layout + ", exchange_budget: 0}}\n"
               "checkpoint: {dir: " +
               dir / (std::string(device) + placement + std::to_string(rank) + (layout == layouts[1] ? "pp" : "")) +
               ", interval: 0, keep_last: 0, save_final: false}\n";
      };
      const Emulated gpu = emulate(yaml("cuda"), rank, 4), cpu = emulate(yaml("cpu"), rank, 4);
      const MemoryPlan &a = gpu.allocated, &p = gpu.planned;
      CHECK(a.weights == p.weights);
      CHECK(a.grads == p.grads);
      CHECK(a.optimizer_state == p.optimizer_state);
      CHECK(a.host_grad_staging == p.host_grad_staging);
      CHECK(a.activations == p.activations);
      CHECK(a.batch == p.batch);
      CHECK(a.host_optimizer_state == p.host_optimizer_state);
      CHECK(a.host_staging == p.host_staging);
      CHECK(a.host_activations == p.host_activations);
      for (double l : gpu.losses) CHECK(std::isfinite(l));
      // The device rank also agrees with the others on its backends' workspaces once they are
      // built (one host all-reduce, max, that the CPU backend has no reason for): skipped once.
      const std::vector<std::string>&c = cpu.log.entries(), &g = gpu.log.entries();
      REQUIRE(c.size() > 50);
      REQUIRE(g.size() == c.size() + 1);
      static const std::regex workspaces("world\\(4\\) all_reduce_host 1 max$");
      size_t skipped = 0;
      for (size_t i = 0; i < c.size(); ++i) {
        if (!skipped && shape_only(g[i]) != shape_only(c[i]) && std::regex_search(g[i], workspaces))
          skipped = 1;
        INFO("collective " << i << ": cpu " << c[i] << ", gpu " << g[i + skipped]);
        REQUIRE(shape_only(g[i + skipped]) == shape_only(c[i]));
      }
      CHECK((skipped == 1 || std::regex_search(g.back(), workspaces)));
    }
  }
}

#endif  // MOP_HAVE_CUDA
