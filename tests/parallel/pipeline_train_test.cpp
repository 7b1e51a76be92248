// Pipeline stages (parallel.pp) trained on in-process CPU ranks against the same run without
// them: twenty steps with gradient clipping binding give the same gradient norms and a final
// checkpoint with the same bytes in every tensor (weights, master weights, Adam moments), with
// every stage's rank writing its own parameters; 1F1B with pp 2 and 4, several micro-batches,
// beside data and expert parallelism inside a stage, sliced parameters and the state in host
// memory; interleaved with two chunks a rank, alone, beside data and expert parallelism, and sliced;
// beside sequence shards (cp 2: Ulysses under 1F1B, ring interleaved); one micro-batch. A run saved
// with stages resumes without them
// and the reverse, to the same bytes. The global norm is exact, so stages that each
// hold a part of the gradients give the bits of the whole.
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "catch.h"
#include "parallel/inprocess_comm.h"
#include "parallel/run_compare.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

const double kClip = 0.05;  // below every step's norm here: clipping binds throughout
const int kSteps = 20;

struct Layout {
  int pp = 1, dp = 1, ep = 1, edp = 1, micro_batches = 4;
  std::string shard = "owner", state = "auto";
  int chunks = 1;  // > 1: interleaved, virtual stages per rank
  int cp = 1;      // attention's sequence shards (cp × dp ranks a stage, = ep × edp)
  std::string cp_impl = "ulysses";
  int ranks() const { return pp * cp * dp; }
};

std::string config(const std::string& corpus, const std::string& dir, const Layout& l, int steps = kSteps) {
  const int micro = 2;
  // Evaluated every 5 steps on held-out data (a tenth of the corpus).
  return test::merge_yaml(test::compare_model_yaml(false, corpus), "data: {valid_fraction: 0.1}\n") +
         "optim: {lr: 0.01, schedule: constant, warmup_steps: 0, grad_clip: " + std::to_string(kClip) +
         ", state_placement: " + l.state + "}\n"
         "train: {steps: " + std::to_string(steps) +
         ", global_batch_size: " + std::to_string(micro * l.dp * l.micro_batches) +
         ", micro_batch_size: " + std::to_string(micro) + ", eval_interval: 5, eval_batches: 2, device: cpu}\n"
         "parallel: {pp: " + std::to_string(l.pp) +
         (l.chunks > 1 ? ", pipeline: {schedule: interleaved, virtual_stages: " + std::to_string(l.chunks) + "}"
                       : std::string()) +
         ", shard: " + l.shard + ", attention: {cp: " + std::to_string(l.cp) + ", impl: " + l.cp_impl + ", dp: " +
         std::to_string(l.dp) + "}, moe: {ep: " + std::to_string(l.ep) + ", dp: " + std::to_string(l.edp) + "}}\n"
         "checkpoint: {dir: " + dir + ", interval: 0, keep_last: 0, resume: auto}\n"
         "log: {interval: 1, router_histogram: " + dir + "/router.json}\n";
}

// The evaluation losses a run logged (metrics.jsonl in `dir`), as text (equal ⇔ equal bits).
std::vector<std::string> val_losses(const std::string& dir) {
  std::vector<std::string> out;
  for (const Json& j : test::read_metrics(dir + "/metrics.jsonl"))
    if (const Json* v = j.find("val_loss")) out.push_back(v->dump());
  return out;
}

std::string text_of(const std::string& path) {
  std::ifstream in(path);
  REQUIRE(in.good());
  return std::string(std::istreambuf_iterator<char>(in), {});
}

void train(const std::string& corpus, const std::string& dir, const Layout& l, int steps = kSteps) {
  const int N = l.ranks();
  std::shared_ptr<InProcessWorld> ranks = make_inprocess_world(N);
  run_inprocess(N, [&](int rank) {
    World w = inprocess_world(ranks, rank, N);
    Trainer t(load_config_text(config(corpus, dir, l, steps)), w);
    t.run();
  });
}

}  // namespace

TEST_CASE("pipeline stages train as the same model without them, bit for bit", "[cpu][pipeline]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 40000);
  struct Case {
    Layout plain, piped;
  };
  const Case cases[] = {
      {{1, 1, 1, 1, 4}, {2, 1, 1, 1, 4}},  // two stages, four micro-batches in flight over them
      {{1, 1, 1, 1, 3}, {4, 1, 1, 1, 3}},  // four stages (a layer, the embedding, the head alone)
      {{1, 2, 2, 1, 2}, {2, 2, 2, 1, 2}},  // data and expert parallelism inside each stage
      // Sliced parameters: the dense ones over dp 2, the experts over their dp 2 (ep 1).
      {{1, 2, 1, 2, 2, "slice"}, {2, 2, 1, 2, 2, "slice"}},
      {{1, 2, 2, 1, 1, "slice"}, {2, 2, 2, 1, 1, "slice"}},  // one micro-batch: gradients pooled
      // The optimizer state in host memory (the host pipeline's update), whole and sliced.
      {{1, 1, 1, 1, 3, "owner", "host"}, {2, 1, 1, 1, 3, "owner", "host"}},
      {{1, 2, 1, 2, 2, "slice", "host"}, {2, 2, 1, 2, 2, "slice", "host"}},
      // Interleaved: two chunks a rank (the four segments each a virtual stage), alone, beside data
      // and expert parallelism, and sliced.
      {{1, 1, 1, 1, 4}, {2, 1, 1, 1, 4, "owner", "auto", 2}},
      {{1, 2, 2, 1, 2}, {2, 2, 2, 1, 2, "owner", "auto", 2}},
      {{1, 2, 1, 2, 4, "slice"}, {2, 2, 1, 2, 4, "slice", "auto", 2}},
      // Sequence shards inside each stage (cp 2 × ep 2): Ulysses under 1F1B, ring interleaved.
      {{1, 1, 2, 1, 2, "owner", "auto", 1, 2}, {2, 1, 2, 1, 2, "owner", "auto", 1, 2}},
      {{1, 1, 2, 1, 4, "owner", "auto", 1, 2, "ring"}, {2, 1, 2, 1, 4, "owner", "auto", 2, 2, "ring"}},
      {{1, 1, 1, 1, 1}, {2, 1, 1, 1, 1}},  // one micro-batch: no pass overlaps another
  };
  int i = 0;
  for (const Case& c : cases) {
    INFO("pp " << c.piped.pp << " cp " << c.piped.cp << " " << c.piped.cp_impl << " dp " << c.piped.dp << " ep "
               << c.piped.ep << " micro-batches "
               << c.piped.micro_batches << " " << c.piped.shard << " state " << c.piped.state << " chunks "
               << c.piped.chunks);
    const std::string root = dir / ("run" + std::to_string(i++));
    train(corpus, root + "/plain", c.plain);
    train(corpus, root + "/piped", c.piped);
    // Checkpoints are layout-free: half the run with stages, the rest without, and the reverse.
    train(corpus, root + "/in", c.piped, kSteps / 2);
    train(corpus, root + "/in", c.plain);
    train(corpus, root + "/out", c.plain, kSteps / 2);
    train(corpus, root + "/out", c.piped);
    test::check_same_runs(root, "plain", "piped", {"grad_norm"}, {"piped", "in", "out"}, kSteps);
    // The routers' counts summed over the stages: each token once, each layer's rows by its stage.
    CHECK(text_of(root + "/plain/router.json") == text_of(root + "/piped/router.json"));
    // Evaluation through the stages: the same loss on held-out data.
    CHECK(val_losses(root + "/plain").size() == size_t(kSteps / 5));
    CHECK(val_losses(root + "/plain") == val_losses(root + "/piped"));
    CHECK(test::steps_clipped(root + "/plain", kClip) == kSteps);
  }
}
