// One memory estimator: what `mop plan` / `mop validate` predict for a rank (make_plan on the
// built-in machine, planned apart from any trainer) equals what that rank's trainer allocates,
// class by class and per activation component — over a grid of recompute, micro-batch size,
// optimizer-state placement, dense layers, shared experts, tied heads and LM-head chunks on one
// rank, and of cp (Ulysses and ring), ep and ZeRO on N CPU ranks (mpirun -np 2 and 4).
#include <mpi.h>
#include <spdlog/spdlog.h>

#include <string>

#include "catch.h"
#include "data/prepare_data.h"
#include "parallel/mpi_comm.h"
#include "parallel/mpi_corpus.h"
#include "plan/plan.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

// Every class of the trainer's allocation against the independent plan's estimate of that rank.
void check_same(const MemoryPlan& planned, const MemoryPlan& got) {
  CHECK(planned.weights == got.weights);
  CHECK(planned.grads == got.grads);
  CHECK(planned.optimizer_state == got.optimizer_state);
  CHECK(planned.host_grad_staging == got.host_grad_staging);
  CHECK(planned.activations == got.activations);
  for (int c = 0; c < kNumComponents; ++c) {
    INFO("activations of " << component_name(Component(c)));
    CHECK(planned.activations_by_component[size_t(c)] == got.activations_by_component[size_t(c)]);
  }
  CHECK(planned.workspaces == got.workspaces);
  CHECK(planned.batch == got.batch);
  CHECK(planned.host_optimizer_state == got.host_optimizer_state);
  CHECK(planned.host_staging == got.host_staging);
  CHECK(planned.host_activations == got.host_activations);
  CHECK(planned.device_total() == got.device_total());
  CHECK(planned.device_total() > 0);
}

}  // namespace

TEST_CASE("plan: memory per class equals the trainer's allocation on one rank", "[cpu][plan]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  test::prepare_corpus(dir, 20000);
  struct Case {
    bool recompute;
    int micro_batch;
    std::string placement, moe_extra, model_extra;
    int lm_head_chunk;
    std::string train_extra = "";  // the long-sequence placements
  };
  const std::vector<Case> cases = {
      {false, 1, "auto", "", "", 1024},
      {true, 1, "auto", "", "", 1024},
      {false, 2, "host", "", "", 7},
      {true, 2, "host", "first_dense_layers: 1, dense_ffn: 24", "", 5},
      {false, 4, "auto", "shared_expert_ffn: 12", "tie_embeddings: true", 1024},
      {true, 1, "host", "first_dense_layers: 2", "qk_norm: false", 3},
      {false, 2, "gpu", "num_experts: 5, top_k: 5", "", 16},
      {true, 2, "auto", "first_dense_layers: 1, dense_ffn: 24, shared_expert_ffn: 12", "", 5,
       ", moe_chunk: 7, offload_layers: 2, keep_attention: 1"},
      {true, 1, "host", "", "", 1024, ", moe_chunk: 1, offload_layers: 3, keep_attention: 3"},
      {false, 1, "auto", "", "", 1024, ", moe_chunk: 5"},
  };
  for (size_t i = 0; i < cases.size(); ++i) {
    const Case& c = cases[i];
    INFO("case " << i << ": recompute " << c.recompute << ", micro-batch " << c.micro_batch << ", state "
                 << c.placement << ", " << c.moe_extra << " " << c.model_extra << ", chunk " << c.lm_head_chunk
                 << c.train_extra);
    const std::string yaml = test::merge_yaml(
        "model: {vocab_size: 257, hidden_size: 24, num_layers: 3, num_heads: 4, num_kv_heads: 2, head_dim: 6}\n"
        "moe: {num_experts: 4, top_k: 2, expert_ffn: 10}\n",
        "model: {" + c.model_extra + "}\nmoe: {" + c.moe_extra + "}\n") +
        "optim: {state_placement: " + c.placement + "}\n" +
        "data: {paths: [" + dir / "corpus" + "], seq_len: 13}\n" +
        "train: {steps: 1, global_batch_size: 4, micro_batch_size: " + std::to_string(c.micro_batch) +
        ", device: cpu, recompute: " + (c.recompute ? "true" : "false") +
        ", lm_head_chunk: " + std::to_string(c.lm_head_chunk) + c.train_extra + "}\n" +
        "checkpoint: {dir: " + dir / ("ckpt" + std::to_string(i)) + ", save_final: false}\n";
    const Config cfg = load_config_text(yaml);
    World w;
    w.comm = make_self_comm();
    Trainer t(cfg, w);
    const Plan planned = make_plan(cfg, builtin_machine("cpu"), 1);
    check_same(planned.memory_of_rank(0), t.allocated_memory());
    CHECK((c.placement == "host") == (planned.memory.host_optimizer_state > 0));
  }
}

TEST_CASE("plan: memory per class equals every rank's allocation for every cp and ep", "[mpi]") {
  int N = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &N);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  spdlog::set_level(spdlog::level::warn);
  const test::SharedCorpus corpus = test::shared_corpus(20000);
  struct Case {
    int cp, ep;
    std::string impl;
    bool zero, recompute;
    std::string placement;
    std::string moe_extra = "";  // parallel.moe settings
  };
  std::vector<Case> cases;
  for (int cp : {1, 2, 4})
    for (int ep : {1, 2, 4}) {
      if (N % cp || N % ep) continue;
      cases.push_back({cp, ep, "ulysses", true, false, "auto"});
      if (cp > 1) cases.push_back({cp, ep, "ring", false, true, "host"});
    }
  cases.push_back({1, N, "auto", true, true, "host"});
  // Bounded receive buffers (the expert exchange in rounds), also with the MoE block in chunks.
  cases.push_back({1, N, "auto", false, false, "auto", ", exchange_budget: 0.4"});
  cases.push_back({1, N, "auto", false, true, "auto", ", exchange_budget: 0.7"});
  for (const Case& c : cases) {
    INFO("N " << N << " cp " << c.cp << " " << c.impl << " ep " << c.ep << " zero " << c.zero << " recompute "
              << c.recompute << " state " << c.placement << c.moe_extra);
    const std::string yaml =
        "model: {vocab_size: 257, hidden_size: 32, num_layers: 2, num_heads: 4, num_kv_heads: 4, head_dim: 8}\n"
        "moe: {num_experts: 8, top_k: 2, expert_ffn: 12, first_dense_layers: 1, dense_ffn: 20}\n"
        "optim: {state_placement: " + c.placement + "}\n"
        "data: {paths: [" + corpus.root + "/corpus], seq_len: 16}\n"
        "train: {steps: 1, global_batch_size: " + std::to_string(2 * N / c.cp) +
        ", micro_batch_size: 1, device: cpu, recompute: " + (c.recompute ? "true" : "false") + "}\n"
        "parallel: {attention: {cp: " + std::to_string(c.cp) + ", dp: " + std::to_string(N / c.cp) +
        ", impl: " + c.impl + "}, moe: {ep: " + std::to_string(c.ep) + ", dp: " + std::to_string(N / c.ep) +
        c.moe_extra + "}, zero: " + (c.zero ? "true" : "false") + "}\n"
        "checkpoint: {dir: " + corpus.root + "/ckpt, save_final: false}\n";
    const Config cfg = load_config_text(yaml);
    World w;
    w.rank = me, w.size = N, w.mpi = true, w.local_rank = me;
    w.comm = make_mpi_comm(MPI_COMM_WORLD);
    Trainer t(cfg, w);
    const Plan planned = make_plan(cfg, builtin_machine("cpu"), N);
    CHECK(planned.ring == (c.impl == "ring"));
    check_same(planned.memory_of_rank(me), t.allocated_memory());
    // The plan's worst rank is the one that needs the most.
    CHECK(planned.memory.device_total() >= planned.memory_of_rank(me).device_total());
    MPI_Barrier(MPI_COMM_WORLD);
  }
}

// parallel.moe.exchange_budget: the receive-side buffers (routed rows of this rank's experts,
// their intermediates and gradients, the dispatch scratch and index maps) shrink from the worst
// case ep · T · top_k rows to the budget's rows; the rest of the plan does not move.
TEST_CASE("plan: an exchange budget bounds the receive buffers", "[cpu][plan][exchange]") {
  const ModelDims d = ModelDims::from(load_config_text(R"(
model: {vocab_size: 151936, hidden_size: 2048, num_layers: 4, num_heads: 32, num_kv_heads: 4, head_dim: 128}
moe: {num_experts: 128, top_k: 8, expert_ffn: 768}
)"), 0, 8);
  ActivationOptions o;
  o.max_batch = 1, o.max_seq = 4096, o.ep = 8, o.compute = DType::BF16, o.moe_chunks = 2;
  const int64_t TK = 4096 * 8;
  CHECK(exchange_rows(0, TK, 8) == 0);
  CHECK(exchange_rows(0.5, TK, 1) == 0);       // no exchange with ep 1
  CHECK(exchange_rows(8, TK, 8) == 0);         // the worst case itself
  CHECK(exchange_rows(1 << 20, TK, 8) == 0);   // huge budgets: the worst case
  CHECK(exchange_rows(1e-12, TK, 8) == 1);     // at least one row
  CHECK(exchange_rows(1.5, TK, 8) == TK * 3 / 2);
  CHECK(exchange_rows(0.1, 7, 8) == 1);        // ⌈0.7⌉
  CHECK(receive_rows(o, TK) == 8 * TK);
  const ActivationLayout worst = plan_activations(d, o);
  o.exchange_rows = exchange_rows(1.5, TK, 8);
  CHECK(receive_rows(o, TK) == TK * 3 / 2);
  const ActivationLayout bounded = plan_activations(d, o);
  // Per layer (no recompute: 4 sets): gu, h, xp_local, yp_local; shared: dh, dgu, dyp_local,
  // dxp_local, the dispatch scratch; the dispatchers' maps (2 I32 per row, one per set).
  const int64_t F = 768, H = 2048, rows_saved = 8 * TK - TK * 3 / 2;
  const auto experts = [](const ActivationLayout& L) { return L.device_by_component()[size_t(Component::Experts)]; };
  const auto grads = [](const ActivationLayout& L) { return L.device_by_component()[size_t(Component::Gradients)]; };
  const size_t slack = size_t(64) << 10;  // slot alignment
  const size_t expert_saved = size_t(rows_saved) * (4 * (3 * F + 2 * H) * 2 + 4 * 2 * 4);
  CHECK(experts(worst) - experts(bounded) + slack >= expert_saved);
  CHECK(experts(worst) - experts(bounded) <= expert_saved + slack);
  const size_t grad_saved = size_t(rows_saved) * (3 * F + 3 * H) * 2;
  CHECK(grads(worst) - grads(bounded) + slack >= grad_saved);
  CHECK(grads(worst) - grads(bounded) <= grad_saved + slack);
  CHECK(bounded.dispatch_device_bytes == size_t(4) * 2 * (TK * 3 / 2) * 4);
  for (int c : {0, 1, 2, 4, 5})  // nothing else moves
    CHECK(worst.device_by_component()[size_t(c)] == bounded.device_by_component()[size_t(c)]);
  // A budget past the worst case plans the worst case.
  o.exchange_rows = 100 * TK;
  CHECK(plan_activations(d, o).device_bytes() == worst.device_bytes());
}
