// mop emulate: rank R of an N-rank job run alone with stand-in comms builds what rank R of the real
// job builds — every memory class byte for byte — and issues the same collectives in the same
// order with the same shapes; a job whose plan does not fit is refused before anything is
// allocated.
#include <mpi.h>
#include <spdlog/spdlog.h>

#include "catch.h"
#include "cli/emulate.h"
#include "core/error.h"
#include "parallel/collective_log.h"
#include "parallel/inprocess_comm.h"
#include "parallel/mpi_comm.h"
#include "parallel/mpi_corpus.h"
#include "parallel/routing_model.h"
#include "parallel/run_compare.h"
#include "parallel/standin_comm.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

// 4 ranks: attention cp 2 × dp 2, experts ep 2 × dp 2 (or two pipeline stages of attention dp 2,
// experts ep 2); the optimizer state on the GPU or host, the parameters whole (owner) or sliced.
struct Variant {
  std::string placement, shard;
  bool stages = false;
};
std::string config(const std::string& corpus, const std::string& dir, const Variant& v) {
  return test::compare_model_yaml(false, corpus) +
         "optim: {lr: 0.01, schedule: constant, warmup_steps: 0, state_placement: " + v.placement + "}\n"
         "train: {steps: 2, global_batch_size: 4, micro_batch_size: 1, eval_interval: 0, device: cpu}\n"
         "parallel: {" + std::string(v.stages ? "pp: 2, attention: {cp: 1, dp: 2}, moe: {ep: 2, dp: 1"
                                              : "attention: {cp: 2, dp: 2}, moe: {ep: 2, dp: 2") +
         ", exchange_budget: 0}, shard: " + v.shard + "}\n"
         "checkpoint: {dir: " + dir + ", interval: 0, keep_last: 0, save_final: false}\n"
         "log: {interval: 1}\n";
}

struct RankRun {
  MemoryPlan allocated;
  CollectiveLog log;
};

void run_steps(Trainer& t, int steps) {
  for (int s = 0; s < steps; ++s) t.step_once();
}

void check_same(const RankRun& real, const RankRun& emu) {
  const MemoryPlan& a = real.allocated;
  const MemoryPlan& b = emu.allocated;
  CHECK(a.weights == b.weights);
  CHECK(a.grads == b.grads);
  CHECK(a.optimizer_state == b.optimizer_state);
  CHECK(a.host_grad_staging == b.host_grad_staging);
  CHECK(a.activations == b.activations);
  CHECK(a.workspaces == b.workspaces);
  CHECK(a.batch == b.batch);
  CHECK(a.comms == b.comms);
  CHECK(a.host_optimizer_state == b.host_optimizer_state);
  CHECK(a.host_staging == b.host_staging);
  CHECK(a.host_activations == b.host_activations);
  CHECK(a.activations_by_component == b.activations_by_component);
  REQUIRE(real.log.entries().size() > 50);
  REQUIRE(real.log.entries().size() == emu.log.entries().size());
  for (size_t i = 0; i < real.log.entries().size(); ++i) {
    INFO("collective " << i);
    REQUIRE(real.log.entries()[i] == emu.log.entries()[i]);
  }
}

}  // namespace

TEST_CASE("an emulated rank allocates and communicates as the same rank of the real job", "[cpu][emulate]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 40000);
  const int N = 4, kSteps = 2;
  // With stages, rank 0 is the first stage's and rank 3 the last's: each allocates its stage's
  // share, and sends and receives as the real rank does.
  for (const Variant extra : {Variant{"gpu", "owner"}, Variant{"host", "slice"}, Variant{"gpu", "owner", true},
                              Variant{"host", "slice", true}}) {
    INFO("state " << extra.placement << ", " << extra.shard << (extra.stages ? ", pp 2" : ""));
    std::vector<RankRun> real(N);
    std::shared_ptr<InProcessWorld> ranks = make_inprocess_world(N);
    run_inprocess(N, [&](int rank) {
      World w = inprocess_world(ranks, rank, N);
      w.collective_log = &real[size_t(rank)].log;
      Trainer t(load_config_text(config(corpus, dir / "real", extra)), w);
      real[size_t(rank)].allocated = t.allocated_memory();
      run_steps(t, kSteps);
    });
    const RoutingModel balanced = RoutingModel::parse("balanced", 8, 2);
    for (const int rank : {0, 3}) {
      INFO("rank " << rank);
      auto job = std::make_shared<StandInJob>();
      job->rank = rank, job->size = N;
      job->expert_counts = [&](int layer, int, int64_t rows, int64_t, int32_t* out) {
        balanced.counts(layer, rows / 2, out);
      };
      World w = standin_world(job, N);
      RankRun emu;
      w.collective_log = &emu.log;
      const Config cfg = load_config_text(config(corpus, dir / ("emu" + std::to_string(rank)), extra));
      // The machine the real ranks planned for: this host's, four ranks to the node.
      Trainer t(cfg, w, run_machine(cfg, w));
      emu.allocated = t.allocated_memory();
      run_steps(t, kSteps);
      check_same(real[size_t(rank)], emu);
    }
  }
}

TEST_CASE("mop emulate refuses a job that does not fit before it allocates anything", "[cpu][emulate]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  test::write_text(dir / "big.yaml",
                   "model: {vocab_size: 32000, hidden_size: 8192, num_layers: 64, num_heads: 64, num_kv_heads: 8, "
                   "head_dim: 128}\nmoe: {num_experts: 64, top_k: 8, expert_ffn: 8192}\n"
                   "data: {paths: [none], seq_len: 4096}\ntrain: {device: cpu, global_batch_size: 2, micro_batch_size: 1}\n"
                   "parallel: {attention: {cp: 1, dp: 2}, moe: {ep: 2, dp: 1}}\n");
  EmulateArgs a;
  a.config = dir / "big.yaml";
  a.gpus = 2;
  try {
    cmd_emulate(a);
    FAIL("a job of 10^11 parameters on two CPU ranks was emulated");
  } catch (const UserError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("memory") != std::string::npos);
  }
  // A pipeline keeps its stages and chunks: fewer layers than its virtual stages need are refused.
  test::write_text(dir / "piped.yaml",
                   "model: {vocab_size: 64, hidden_size: 16, num_layers: 4, num_heads: 2, num_kv_heads: 1, head_dim: 8}\n"
                   "moe: {num_experts: 4, top_k: 2, expert_ffn: 8}\n"
                   "data: {paths: [none], seq_len: 16, eos_id: 0}\ntrain: {device: cpu, global_batch_size: 4, micro_batch_size: 1}\n"
                   "parallel: {pp: 2, pipeline: {schedule: interleaved, virtual_stages: 2}, attention: {cp: 1, dp: 1}, "
                   "moe: {ep: 1, dp: 1}}\n");
  a = EmulateArgs();
  a.config = dir / "piped.yaml";
  a.gpus = 2;
  a.layers = 1;
  try {
    cmd_emulate(a);
    FAIL("a pipeline of 4 virtual stages was emulated with one layer");
  } catch (const UserError& e) {
    INFO(e.what());
    CHECK(std::string(e.what()).find("--layers 1: the pipeline's 2 stages × 2 chunks need at least 2 layers") !=
          std::string::npos);
  }
  a.config = dir / "missing.yaml";
  CHECK_THROWS_AS(cmd_emulate(a), UserError);
}

// The same under mpirun: each MPI rank trains two steps of the real job, then emulates itself alone.
TEST_CASE("an emulated rank allocates and communicates as the same rank under mpirun", "[mpi]") {
  int N = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &N);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  if (N % 2) return;
  spdlog::set_level(spdlog::level::warn);
  const test::SharedCorpus corpus = test::shared_corpus(20000);
  const std::string yaml =
      test::compare_model_yaml(false, corpus.root + "/corpus") +
      "optim: {state_placement: host}\n"
      "train: {steps: 2, global_batch_size: " + std::to_string(N / 2) + ", micro_batch_size: 1, device: cpu}\n"
      "parallel: {attention: {cp: 2, dp: " + std::to_string(N / 2) + "}, moe: {ep: 2, dp: " + std::to_string(N / 2) +
      ", exchange_budget: 0}}\n"
      "checkpoint: {dir: " + corpus.root + "/ckpt_emulate, save_final: false}\n";
  const Config cfg = load_config_text(yaml);
  RankRun real;
  {
    World w;
    w.rank = me, w.size = N, w.mpi = true, w.local_rank = me;
    w.comm = make_mpi_comm(MPI_COMM_WORLD);
    w.collective_log = &real.log;
    Trainer t(cfg, w);
    real.allocated = t.allocated_memory();
    run_steps(t, 2);
  }
  MPI_Barrier(MPI_COMM_WORLD);
  auto job = std::make_shared<StandInJob>();
  job->rank = me, job->size = N;
  const RoutingModel balanced = RoutingModel::parse("balanced", 8, 2);
  job->expert_counts = [&](int layer, int, int64_t rows, int64_t, int32_t* out) { balanced.counts(layer, rows / 2, out); };
  World w = standin_world(job, 1);
  RankRun emu;
  w.collective_log = &emu.log;
  Trainer t(cfg, w, run_machine(cfg, w));
  emu.allocated = t.allocated_memory();
  run_steps(t, 2);
  check_same(real, emu);
  MPI_Barrier(MPI_COMM_WORLD);
}
