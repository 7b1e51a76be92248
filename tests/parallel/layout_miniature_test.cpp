// The layouts mop plan picks for moe-1t on 96 ranks, run end to end: a miniature of moe-1t (its
// 384 experts of top 8 and its shared expert, tiny widths, few layers) trained for two steps as 96
// in-process CPU ranks in the layout of the plan, against the same miniature on one rank: the
// losses and gradient norms of every step to fp32 rounding (sums in another order).
//   - 1M tokens (docs/plan.md): cp 32 ring attention × dp 3, ep 96, sliced parameters, recompute.
//   - 8K tokens: pp 12 interleaved × 3 chunks a rank, dp 8 with ep 8 inside each stage, ZeRO-1,
//     recompute (36 virtual stages: 34 layers, the embedding and the head).
#include <cmath>
#include <vector>
#include <filesystem>
#include <string>

#include <spdlog/spdlog.h>

#include "catch.h"
#include "parallel/inprocess_comm.h"
#include "parallel/run_compare.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

const int kSteps = 2;

struct Layout {
  int pp = 1, cp = 1, dp = 1, ep = 1;
  std::string impl = "ulysses", shard = "owner";
  bool zero = false;
  int chunks = 1;  // > 1: interleaved
  int ranks() const { return pp * cp * dp; }
};

// moe-1t in miniature: 384 experts of top 8 with a shared expert, 8 query and 2 KV heads.
std::string config(const std::string& corpus, const std::string& dir, const Layout& l, int layers,
                   int seq, int batch) {
  return "model: {vocab_size: 257, hidden_size: 16, num_layers: " + std::to_string(layers) +
         ", num_heads: 8, num_kv_heads: 2, head_dim: 4, init_std: 0.1, tie_embeddings: false}\n"
         "moe: {num_experts: 384, top_k: 8, expert_ffn: 4, shared_expert_ffn: 8, aux_loss_coef: 0.001}\n"
         "data: {paths: [" + corpus + "], seq_len: " + std::to_string(seq) + "}\n"
         "optim: {lr: 0.01, schedule: constant, warmup_steps: 0, grad_clip: 1.0}\n"
         "train: {steps: " + std::to_string(kSteps) + ", global_batch_size: " + std::to_string(batch) +
         ", micro_batch_size: 1, recompute: true, eval_interval: 0, device: cpu}\n"
         "parallel: {pp: " + std::to_string(l.pp) +
         (l.chunks > 1 ? ", pipeline: {schedule: interleaved, virtual_stages: " + std::to_string(l.chunks) + "}"
                       : std::string()) +
         ", shard: " + l.shard + ", zero: " + (l.zero ? "true" : "false") +
         ", attention: {cp: " + std::to_string(l.cp) + ", dp: " + std::to_string(l.dp) + ", impl: " + l.impl +
         "}, moe: {ep: " + std::to_string(l.ep) + ", dp: " + std::to_string(l.ranks() / l.pp / l.ep) + "}}\n"
         "checkpoint: {dir: " + dir + ", interval: 0, keep_last: 0, resume: none}\n"
         "log: {interval: 1}\n";
}

void train(const std::string& text, int ranks) {
  std::shared_ptr<InProcessWorld> world = make_inprocess_world(ranks);
  run_inprocess(ranks, [&](int rank) {
    World w = inprocess_world(world, rank, ranks);
    Trainer t(load_config_text(text), w);
    t.run();
  });
}

// The largest difference, relative, between what two runs logged for `key` at each step (their
// loss and gradient norm: a step's gradients through another order of sums differ by rounding;
// the weights after Adam's first steps do not compare so: an element whose gradient is rounding
// noise moves by the learning rate either way).
double largest_difference(const std::string& a_dir, const std::string& b_dir, const std::string& key) {
  const std::vector<std::string> a = test::logged(a_dir, key), b = test::logged(b_dir, key);
  REQUIRE(a.size() == size_t(kSteps));
  REQUIRE(b.size() == a.size());
  double worst = 0;
  for (size_t i = 0; i < a.size(); ++i) {
    const double x = std::stod(a[i]), y = std::stod(b[i]);
    worst = std::max(worst, std::fabs(x - y) / std::max(std::fabs(x), 1e-30));
  }
  return worst;
}

}  // namespace

TEST_CASE("moe-1t's 96-rank layouts train a miniature as one rank does", "[cpu][pipeline][slow]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 200000);
  const std::string last = "/step_" + std::to_string(kSteps);
  SECTION("1M tokens: cp 32 ring x dp 3, ep 96, sliced") {
    Layout big;
    big.cp = 32, big.dp = 3, big.ep = 96, big.impl = "ring", big.shard = "slice";
    const int layers = 2, seq = 256, batch = 3;
    train(config(corpus, dir / "one", Layout{}, layers, seq, batch), 1);
    train(config(corpus, dir / "big", big, layers, seq, batch), big.ranks());
    for (const char* key : {"loss", "grad_norm"}) {
      const double diff = largest_difference(dir / "one", dir / "big", key);
      INFO(key << ": largest difference " << diff);
      CHECK(diff < 1e-5);
    }
  }
  SECTION("8K tokens: pp 12 interleaved x 3, dp 8, ep 8, ZeRO-1") {
    Layout big;
    big.pp = 12, big.chunks = 3, big.dp = 8, big.ep = 8, big.zero = true;
    const int layers = 34, seq = 16, batch = 96;  // a segment a virtual stage; 12 micro-batches a pipeline
    Layout one_dp = big;  // the same data and expert parallelism without stages: the same bits
    one_dp.pp = 1, one_dp.chunks = 1;
    train(config(corpus, dir / "one", Layout{}, layers, seq, batch), 1);
    train(config(corpus, dir / "dp", one_dp, layers, seq, batch), one_dp.ranks());
    train(config(corpus, dir / "big", big, layers, seq, batch), big.ranks());
    CHECK(test::differing_tensors(test::checkpoint_tensors((dir / "dp") + last),
                                  test::checkpoint_tensors((dir / "big") + last)) == 0);
    CHECK(test::logged(dir / "dp", "loss") == test::logged(dir / "big", "loss"));
    CHECK(test::logged(dir / "dp", "grad_norm") == test::logged(dir / "big", "grad_norm"));
    for (const char* key : {"loss", "grad_norm"}) {
      const double diff = largest_difference(dir / "one", dir / "big", key);
      INFO(key << ": largest difference " << diff);
      CHECK(diff < 1e-5);
    }
  }
}
