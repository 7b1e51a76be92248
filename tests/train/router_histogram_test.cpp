// log.router_histogram: a CPU run writes the rows each expert of each MoE layer received; every
// layer adds up to tokens × top_k with tokens = steps × global_batch_size × seq_len (training
// passes only: recomputing forwards and evaluation do not count), the same with or without
// recompute and chunking, and on 2 ranks (the world's sum over cp, dp and ep), and the file loads
// as a RoutingModel with those counts.
#include <filesystem>

#include "catch.h"
#include "config/config.h"
#include "parallel/inprocess_comm.h"
#include "parallel/routing_model.h"
#include "runtime/comm.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

// 3 layers, the first dense: 2 MoE layers of 4 experts, top_k 2. A step: 6 sequences of 16 tokens
// in 2 micro-batches of 3 (96 tokens).
constexpr int64_t kExperts = 4, kTopK = 2, kMoeLayers = 2, kTokensPerStep = 6 * 16;

std::string config(const std::string& data, const std::string& ckpt, const std::string& hist,
                   int steps, const std::string& train_extra = "") {
  return R"(
model: {vocab_size: 257, hidden_size: 16, num_layers: 3, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 4, top_k: 2, expert_ffn: 16, first_dense_layers: 1, dense_ffn: 16}
optim: {lr: 0.01, min_lr: 0.001}
data: {paths: [)" + data + R"(], seq_len: 16, valid_fraction: 0.05}
train: {steps: )" + std::to_string(steps) + R"(, global_batch_size: 6, micro_batch_size: 3, seed: 5)" +
         train_extra + R"(}
checkpoint: {dir: )" + ckpt + R"(, keep_last: 0, resume: auto}
log: {interval: 1, router_histogram: )" + hist + R"(}
)";
}

RouterHistogram train_and_read(const std::string& yaml, const std::string& hist) {
  World w;
  w.comm = make_self_comm();
  Trainer t(load_config_text(yaml), w);
  t.run();
  return read_router_histogram(hist, kExperts, kTopK);
}

}  // namespace

TEST_CASE("train: log.router_histogram counts every training token once per MoE layer",
          "[cpu][train][routing]") {
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 20000);
  const int steps = 3;
  const int64_t tokens = steps * kTokensPerStep;

  const std::string plain_path = dir / "out/plain.json";  // its folder is created
  const RouterHistogram plain =
      train_and_read(config(corpus, dir / "plain", plain_path, steps), plain_path);
  CHECK(plain.tokens == tokens);
  REQUIRE(plain.layers() == kMoeLayers);
  for (int64_t l = 0; l < kMoeLayers; ++l) {
    int64_t sum = 0;
    for (int64_t e = 0; e < kExperts; ++e) sum += plain.counts[size_t(l * kExperts + e)];
    CHECK(sum == tokens * kTopK);
  }
  CHECK_FALSE(std::filesystem::exists(plain_path + ".tmp"));

  // Recompute (whole and in chunks of 16 tokens: the experts run again in backward) and
  // evaluation after every step change nothing: the same routing, counted once.
  for (const std::string extra :
       {", recompute: true, moe_chunk: 0", ", recompute: true, moe_chunk: 16",
        ", moe_chunk: 16, eval_interval: 1, eval_batches: 2"}) {
    INFO("train: {..." << extra << "}");
    const std::string path = dir / "variant.json";
    std::filesystem::remove_all(dir / "variant");
    const RouterHistogram v =
        train_and_read(config(corpus, dir / "variant", path, steps, extra), path);
    CHECK(v.tokens == tokens);
    CHECK(v.counts == plain.counts);
  }

  // The file is a routing model whose shares give back its counts.
  const RoutingModel m = RoutingModel::parse(plain_path, kExperts, kTopK);
  REQUIRE(m.layers() == kMoeLayers);
  for (int l = 0; l < kMoeLayers; ++l) {
    std::vector<int32_t> c(kExperts);
    m.counts(l, tokens, c.data());
    CHECK(std::vector<int64_t>(c.begin(), c.end()) ==
          std::vector<int64_t>(plain.counts.begin() + l * kExperts,
                               plain.counts.begin() + (l + 1) * kExperts));
  }
}

TEST_CASE("train: the router histogram of 2 in-process ranks sums every rank's tokens",
          "[cpu][train][routing]") {
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 20000);
  const int steps = 2;
  // Sequences split over cp, batches over dp, experts over ep: each rank routes its own tokens to
  // all 4 experts, and the world's sum is every token once.
  int i = 0;
  for (const char* parallel : {"{attention: {cp: 2, dp: 1}, moe: {ep: 2, dp: 1}}",
                               "{attention: {cp: 1, dp: 2}, moe: {ep: 2, dp: 1}}",
                               "{attention: {cp: 1, dp: 2}, moe: {ep: 1, dp: 2}}"}) {
    INFO("parallel: " << parallel);
    const std::string run = dir / ("run" + std::to_string(i++)), hist = run + ".json";
    const std::string yaml = config(corpus, run, hist, steps) + "parallel: " + parallel + "\n";
    std::shared_ptr<InProcessWorld> ranks = make_inprocess_world(2);
    run_inprocess(2, [&](int rank) {
      World w = inprocess_world(ranks, rank, 2);
      Trainer(load_config_text(yaml), w).run();
    });
    const RouterHistogram h = read_router_histogram(hist, kExperts, kTopK);
    CHECK(h.tokens == steps * kTokensPerStep);
    CHECK(h.layers() == kMoeLayers);  // the reader checked each layer's sum: tokens × top_k
  }
}

TEST_CASE("train: the router histogram is written at checkpoints; a resume counts its own steps",
          "[cpu][train][routing]") {
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 20000);
  const std::string hist = dir / "hist.json";
  // Exits after step 2 with a checkpoint (train.exit_interval): the file holds steps 1–2.
  const std::string yaml = config(corpus, dir / "ckpt", hist, 3, ", exit_interval: 2");
  CHECK(train_and_read(yaml, hist).tokens == 2 * kTokensPerStep);
  // The resumed process trains step 3 and replaces the file with what it counted.
  CHECK(train_and_read(yaml, hist).tokens == kTokensPerStep);
}

TEST_CASE("config: log.router_histogram needs an MoE layer", "[cpu][config][routing]") {
  CHECK_USER_ERROR(load_config_text("model: {num_layers: 2}\nmoe: {first_dense_layers: 2}\n"
                                    "log: {router_histogram: h.json}\n"),
                   "log.router_histogram: the model has no MoE layers");
  CHECK_NOTHROW(load_config_text("model: {num_layers: 2}\nmoe: {first_dense_layers: 1}\n"
                                 "log: {router_histogram: h.json}\n"));
}
