// Evaluation runs its program (plan/program.h, make_eval_program): sliced parameters (gathered one
// segment ahead, a tied embedding in its own slot), host-held state updated beside the next step
// (each segment's evaluation waits for its weights) and streamed gradients give the evaluation
// losses of whole parameters with the backend's state, bit for bit, on one rank and on 2
// in-process ranks.
#include <memory>
#include <string>
#include <vector>

#include <spdlog/spdlog.h>

#include "catch.h"
#include "parallel/inprocess_comm.h"
#include "parallel/run_compare.h"
#include "parallel/world.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

constexpr int kSteps = 4;  // evaluated after steps 2 and 4

// The runs of run_compare.h with held-out data, on `ranks` data-parallel ranks; `optim`: more
// optimizer settings (", key: value").
std::string config(const std::string& corpus, const std::string& dir, bool tied, int ranks, const std::string& optim,
                   const std::string& shard, int micro_batches) {
  std::string model = test::compare_model_yaml(tied, corpus);
  const std::string data_end = "eod_mask_loss: true}";
  model.replace(model.find(data_end), data_end.size(), "eod_mask_loss: true, valid_fraction: 0.05}");
  return model + "optim: {lr: 0.01, schedule: constant, warmup_steps: 0" + optim +
         "}\n"
         "train: {steps: " + std::to_string(kSteps) + ", global_batch_size: " + std::to_string(2 * ranks * micro_batches) +
         ", micro_batch_size: 2, eval_interval: 2, eval_batches: 2, device: cpu}\n"
         "parallel: {shard: " + shard + ", attention: {dp: " + std::to_string(ranks) + "}, moe: {dp: " +
         std::to_string(ranks) +
         "}}\n"
         "checkpoint: {dir: " + dir + ", interval: 0, keep_last: 0}\n"
         "log: {interval: 1}\n";
}

std::vector<std::string> val_losses(const std::string& dir) {
  std::vector<std::string> out;
  for (const Json& j : test::read_metrics(dir + "/metrics.jsonl"))
    if (const Json* v = j.find("val_loss")) out.push_back(v->dump());
  return out;
}

struct Variant {
  const char* name;
  std::string optim, shard;
  int micro_batches = 1;
};

}  // namespace

TEST_CASE("evaluation: sliced, host-updated and streamed runs evaluate as whole ones, bit for bit", "[cpu][eval]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 40000);
  const std::vector<Variant> variants = {
      {"slice", "", "slice"},
      {"slice, 2 micro-batches", "", "slice", 2},
      {"slice, host state", ", state_placement: host", "slice"},
      {"host state, overlapped", ", state_placement: host", "owner"},
      {"host state, streamed, 2 micro-batches", ", state_placement: host, gradients: host", "owner", 2},
  };
  int i = 0;
  for (const int ranks : {1, 2})
    for (const bool tied : {false, true}) {
      auto train = [&](const std::string& run, const Variant& v, int micro_batches) {
        const std::string yaml = config(corpus, dir / run, tied, ranks, v.optim, v.shard, micro_batches);
        std::shared_ptr<InProcessWorld> world = make_inprocess_world(ranks);
        run_inprocess(ranks, [&](int rank) {
          World w = inprocess_world(world, rank, ranks);
          Trainer t(load_config_text(yaml), w);
          t.run();
        });
        return val_losses(dir / run);
      };
      for (const int mb : {1, 2}) {
        const std::string base = "whole" + std::to_string(i++);
        const std::vector<std::string> want = train(base, {"whole", "", "owner"}, mb);
        REQUIRE(want.size() == 2);
        CHECK(want[0] != want[1]);  // it trains
        for (const Variant& v : variants) {
          if (v.micro_batches != mb) continue;
          INFO(ranks << " rank(s), tied " << tied << ", " << v.name);
          CHECK(train("run" + std::to_string(i++), v, mb) == want);
        }
      }
    }
}
