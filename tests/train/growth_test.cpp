// Progressive expert growth (train/growth.h): the schedule from the config, the grown checkpoint
// (copies byte-equal to their source, router rows equal without noise, moments copied or zero,
// everything else kept), and a run resumed before, at and after a boundary equals one that never
// stopped, bit for bit — the state passed in memory against through the grown checkpoint, with
// the optimizer state in the backend's memory and in host memory, and from a boundary checkpoint
// the job saved but did not grow.
#include <cmath>
#include <filesystem>
#include <fstream>

#include "catch.h"
#include "ckpt/checkpoint_dir.h"
#include "model/hf_tensors.h"
#include "ckpt/manifest.h"
#include "config/config.h"
#include "core/error.h"
#include "train/checkpointing.h"
#include "train/growth.h"
#include "train/train_test_util.h"

using namespace mop;

namespace {

std::string growth_yaml(const std::string& data, const std::string& ckpt, const std::string& growth,
                        int experts) {
  return "model: {vocab_size: 257, hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1}\n"
         "moe: {num_experts: " + std::to_string(experts) + ", top_k: 2, expert_ffn: 16, aux_loss_coef: 0.01" +
         (growth.empty() ? "" : ", growth: " + growth) + "}\n"
         "optim: {lr: 0.01, min_lr: 0.001, warmup_steps: 2}\n"
         "data: {paths: [" + data + "], seq_len: 16}\n"
         "train: {steps: 9, global_batch_size: 4, micro_batch_size: 2, seed: 7}\n"
         "checkpoint: {dir: " + ckpt + ", keep_last: 0, resume: auto}\n"
         "log: {interval: 1}\n";
}

int64_t stage_of(const std::string& checkpoint) {
  const Json* s = read_manifest(checkpoint).state.find("growth_stage");
  return s ? s->as_int64() : 0;
}

std::string bytes_of(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

std::vector<float> floats(const SafetensorsTensor* t) {
  REQUIRE(t);
  const float* p = static_cast<const float*>(t->data);
  return std::vector<float>(p, p + t->numel());
}

constexpr const char* kStages = "[{experts: 2, steps: 3}, {experts: 4, steps: 3}, {experts: 8}]";

}  // namespace

TEST_CASE("growth: the schedule resolves budgets to steps; a run's config ends at its experts", "[cpu][train]") {
  Config c = load_config_text(growth_yaml("d", "c", "[{experts: 2, tokens: 192}, {experts: 4, steps: 2}, {experts: 8}]", 8));
  GrowthSchedule g = growth_schedule(c);  // 64 tokens per step: 192 tokens are 3 steps
  CHECK(g.experts == std::vector<int64_t>{2, 4, 8});
  CHECK(g.end_step == std::vector<int64_t>{3, 5, 9});
  CHECK(g.stage_at(0) == 0);
  CHECK(g.stage_at(2) == 0);
  CHECK(g.stage_at(3) == 1);  // a boundary checkpoint holds the grown model
  CHECK(g.stage_at(5) == 2);
  CHECK(g.stage_at(9) == 2);
  CHECK(g.is_boundary(3));
  CHECK(g.is_boundary(5));
  CHECK_FALSE(g.is_boundary(9));
  CHECK_FALSE(g.is_boundary(4));
  CHECK(stage_config(c, g, 1).moe.num_experts == 4);
  // The doubling shorthand: 2 → 4 → 8 over 9 steps with 1 : 2 : 4 of the steps.
  Config d = load_config_text(growth_yaml("d", "c", "", 8), {"moe.growth_from=2"});
  GrowthSchedule h = growth_schedule(d);
  CHECK(h.experts == std::vector<int64_t>{2, 4, 8});
  CHECK(h.end_step == std::vector<int64_t>{1, 4, 9});
  CHECK(growth_schedule(load_config_text(growth_yaml("d", "c", "", 8))).empty());
  // The first stage's config (its checkpoints') holds growth_from experts; a run's may not.
  CHECK(load_config_text(growth_yaml("d", "c", "", 2), {"moe.growth_from=2"}).moe.num_experts == 2);
  CHECK_THROWS_WITH(growth_schedule(load_config_text(growth_yaml("d", "c", "", 2), {"moe.growth_from=2"})),
                    "moe.growth_from: 2 is not fewer than moe.num_experts (2): nothing to grow");
  // A stage's checkpoint config is not a run's.
  CHECK_THROWS_WITH(growth_schedule(load_config_text(growth_yaml("d", "c", kStages, 4))),
                    "moe.growth: the last stage has 8 experts, moe.num_experts is 4; the last stage's count is the model's");
  CHECK_THROWS_WITH(growth_schedule(load_config_text(growth_yaml("d", "c", "", 8), {"moe.growth_from=2", "train.steps=2"})),
                    Catch::Matchers::Contains("gets no step of the run's 2"));
}

TEST_CASE("growth: a grown checkpoint's copies equal their source expert", "[cpu][train]") {
  test::TempDir dir;
  const std::string data = test::prepare_corpus(dir, 20000);
  // Two steps with 2 experts, then grow the checkpoint (copies of it) to 6.
  test::write_text(dir / "two.yaml", growth_yaml(data, dir / "two", "", 2));
  auto r = test::run_mop("train --config " + dir / "two.yaml" + " --set train.steps=2");
  INFO(r.output);
  REQUIRE(r.code == 0);
  // An extra file in the checkpoint (a tokenizer) travels with the growth: the step re-committed
  // with it, as the trainer writes one.
  std::filesystem::rename(dir / "two/step_2", dir / "keep");
  {
    CheckpointWriter w = CheckpointWriter::begin(dir / "two", 2);
    for (const auto& e : std::filesystem::directory_iterator(dir / "keep"))
      if (e.path().filename() != "manifest.json")
        std::filesystem::copy_file(e.path(), w.file(e.path().filename().string()));
    test::write_text(w.file("tokenizer.json"), "{\"kept\": true}");
    Manifest m = read_manifest(dir / "keep");
    m.files.clear();
    w.commit(std::move(m));
  }
  const std::string src = dir / "two/step_2";
  for (const char* name : {"exact", "noisy"}) {
    std::filesystem::create_directories(dir / name);
    std::filesystem::copy(src, dir / (std::string(name) + "/step_2"), std::filesystem::copy_options::recursive);
  }
  grow_checkpoint(dir / "exact/step_2", {6, 0.0, true, 7});
  grow_checkpoint(dir / "noisy/step_2", {6, 0.5, false, 7});

  const HfTensorFiles before(src), exact(dir / "exact/step_2"), noisy(dir / "noisy/step_2");
  CHECK(checkpoint_config(dir / "exact/step_2").moe.num_experts == 6);
  CHECK(read_manifest(dir / "exact/step_2").step == 2);
  CHECK(stage_of(dir / "exact/step_2") == 0);  // grown outside a schedule: no stage recorded
  CHECK(bytes_of(dir / "exact/step_2/tokenizer.json") == "{\"kept\": true}");
  int64_t experts_checked = 0;
  for (const std::string& name : before.names()) {
    INFO(name);
    const size_t at = name.find(".mlp.experts.");
    if (at != std::string::npos) {
      // model.layers.L.mlp.experts.J.*: J becomes 3J, 3J+1, 3J+2, weights and moments alike.
      const size_t b = at + 13, e = name.find('.', b);
      const int64_t j = std::stoll(name.substr(b, e - b));
      for (int64_t c = 0; c < 3; ++c) {
        const std::string copy = name.substr(0, b) + std::to_string(3 * j + c) + name.substr(e);
        CHECK(floats(exact.find(copy)) == floats(before.find(name)));
        const bool moment = name.ends_with(".exp_avg") || name.ends_with(".exp_avg_sq");
        if (moment) {
          std::vector<float> z = floats(noisy.find(copy));
          CHECK(std::all_of(z.begin(), z.end(), [](float x) { return x == 0.0f; }));
        } else {
          CHECK(floats(noisy.find(copy)) == floats(before.find(name)));
        }
        ++experts_checked;
      }
      continue;
    }
    if (name.find(".mlp.gate.weight") != std::string::npos) {
      const std::vector<float> rows = floats(before.find(name)), grown = floats(exact.find(name)),
                               loud = floats(noisy.find(name));
      REQUIRE(rows.size() == 2 * 16);
      REQUIRE(grown.size() == 6 * 16);
      for (int r = 0; r < 6; ++r) {
        const std::vector<float> want(rows.begin() + (r / 3) * 16, rows.begin() + (r / 3 + 1) * 16);
        CHECK(std::vector<float>(grown.begin() + r * 16, grown.begin() + (r + 1) * 16) == want);
        const std::vector<float> got(loud.begin() + r * 16, loud.begin() + (r + 1) * 16);
        if (name.ends_with(".weight") && r % 3 == 0) CHECK(got == want);  // the first copy keeps the row
        if (name.ends_with(".weight") && r % 3 != 0) CHECK(got != want);
      }
      continue;
    }
    CHECK(floats(exact.find(name)) == floats(before.find(name)));  // every other tensor as it was
    CHECK(floats(noisy.find(name)) == floats(before.find(name)));
  }
  CHECK(experts_checked == 2 * 2 * 3 * 3 * 3);  // layers × experts × projections × tensors × copies
  // The same growth of a state held in memory gives the grown checkpoint's tensors, value for
  // value, and consumes the held state (its tensors move into the result: no old + new peak).
  for (const bool copy : {true, false}) {
    INFO("moments " << (copy ? "copied" : "zero"));
    HeldCheckpoint held;
    held.config = checkpoint_config(src);
    for (const std::string& name : before.names()) {
      const SafetensorsTensor* t = before.find(name);
      const std::vector<float> v = floats(t);
      held.put(name, t->shape, HostFloats(v.begin(), v.end()));
    }
    const HeldCheckpoint grown = grow_held(std::move(held), {6, copy ? 0.0 : 0.5, copy, 7});
    const HfTensorFiles& want = copy ? exact : noisy;
    CHECK(held.tensors.empty());
    CHECK(grown.config.moe.num_experts == 6);
    CHECK(grown.tensors.size() == want.names().size());
    for (const std::string& name : want.names()) {
      INFO(name);
      CHECK(floats(grown.find(name)) == floats(want.find(name)));
    }
  }
  CHECK_THROWS_WITH(grow_checkpoint(dir / "exact/step_2", {8, 0.0, true, 7}),
                    Catch::Matchers::Contains("cannot grow its 6 experts to 8 (not a multiple)"));
  // The grown checkpoint is a checkpoint of the 6-expert model: it exports with 6 experts, and a
  // run of it trains on.
  auto hf = test::run_mop("export-hf " + dir / "exact/step_2" + " --out " + dir / "hf");
  INFO(hf.output);
  REQUIRE(hf.code == 0);
  CHECK(bytes_of(dir / "hf/config.json").find("\"num_experts\": 6") != std::string::npos);
  CHECK(bytes_of(dir / "hf/tokenizer.json") == "{\"kept\": true}");
  auto on = test::run_mop("train --config " + dir / "two.yaml" + " --set moe.num_experts=6 --set train.steps=3 "
                          "--set checkpoint.dir=" + dir / "grown_run" + " --set checkpoint.init_from=" + dir / "exact");
  INFO(on.output);
  CHECK(on.code == 0);
}

TEST_CASE("growth: a run resumed before, at and after a boundary equals one that never stopped", "[cpu][train]") {
  test::TempDir dir;
  const std::string data = test::prepare_corpus(dir, 30000);
  for (const std::string placement : {"gpu", "host"}) {
    INFO("optim.state_placement " << placement);
    const std::string set = " --set optim.state_placement=" + placement;
    const std::string straight = dir / ("straight_" + placement);
    test::write_text(straight + ".yaml", growth_yaml(data, straight, kStages, 8));
    auto s = test::run_mop("train --config " + straight + ".yaml" + set);
    INFO(s.output);
    REQUIRE(s.code == 0);
    CHECK(s.output.find("growth: step 3: 2 → 4 experts per MoE layer") != std::string::npos);
    CHECK(s.output.find("growth: step 6: 4 → 8 experts per MoE layer") != std::string::npos);
    // Straight through, no checkpoint is due at the boundaries: the state passes in memory. The
    // runs stopped at a boundary go through the grown checkpoint instead — the same bits.
    CHECK(s.output.find("continuing at step 3 (12 samples consumed) from the state held in memory") != std::string::npos);
    const auto want = test::read_metrics(straight + "/metrics.jsonl");
    REQUIRE(want.size() == 9);
    // Stopped after step 2 (before the first boundary), 3 (at it) and 5 (after it), then resumed.
    for (int stop : {2, 3, 5}) {
      INFO("stopped after step " << stop);
      const std::string split = dir / ("split_" + placement + "_" + std::to_string(stop));
      test::write_text(split + ".yaml", growth_yaml(data, split, kStages, 8));
      auto a = test::run_mop("train --config " + split + ".yaml --set train.exit_interval=" + std::to_string(stop) + set);
      INFO(a.output);
      REQUIRE(a.code == 0);
      auto b = test::run_mop("train --config " + split + ".yaml" + set);
      INFO(b.output);
      REQUIRE(b.code == 0);
      if (stop == 3) CHECK(b.output.find("resumed from " + split + "/step_3 at step 3") != std::string::npos);
      const auto got = test::read_metrics(split + "/metrics.jsonl");
      REQUIRE(got.size() == want.size());
      for (size_t i = 0; i < want.size(); ++i) {
        INFO("step " << i + 1);
        CHECK(got[i].at("loss").dump() == want[i].at("loss").dump());
        CHECK(got[i].at("grad_norm").dump() == want[i].at("grad_norm").dump());
      }
      // Each checkpoint's manifest records the stage whose model it holds (a boundary's: the next).
      CHECK(stage_of(split + "/step_" + std::to_string(stop)) == (stop < 3 ? 1 : 2));
      CHECK(stage_of(split + "/step_9") == 3);
      CHECK(bytes_of(split + "/step_9/model.safetensors") == bytes_of(straight + "/step_9/model.safetensors"));
      CHECK(bytes_of(split + "/step_9/optimizer.safetensors") == bytes_of(straight + "/step_9/optimizer.safetensors"));
    }
  }
  // A job that saved the boundary checkpoint but ended before growing it: the 3 steps of stage 1
  // as a run of its own (2 experts, no schedule), then the schedule resumes from it and grows it.
  const std::string straight = dir / "straight_gpu";
  const std::string late = dir / "late";
  test::write_text(late + ".yaml", growth_yaml(data, late, kStages, 8));
  test::write_text(late + "_first.yaml", growth_yaml(data, late, "", 2));
  auto a = test::run_mop("train --config " + late + "_first.yaml --set train.steps=3");
  INFO(a.output);
  REQUIRE(a.code == 0);
  auto b = test::run_mop("train --config " + late + ".yaml");
  INFO(b.output);
  REQUIRE(b.code == 0);
  CHECK(b.output.find("was saved at the end of stage 1 but not grown; growing it") != std::string::npos);
  CHECK(stage_of(late + "/step_3") == 2);
  const auto want = test::read_metrics(straight + "/metrics.jsonl"), got = test::read_metrics(late + "/metrics.jsonl");
  REQUIRE(got.size() == want.size());
  for (size_t i = 0; i < want.size(); ++i) CHECK(got[i].at("loss").dump() == want[i].at("loss").dump());
  // The doubling shorthand trains through its stages (2 → 4 → 8 after steps 1 and 4).
  auto d = test::run_mop("train --config " + late + ".yaml --set moe.growth=[] --set moe.growth_from=2 "
                         "--set checkpoint.dir=" + dir / "doubling");
  INFO(d.output);
  CHECK(d.code == 0);
  CHECK(d.output.find("growth: step 4: 4 → 8 experts per MoE layer") != std::string::npos);
  CHECK(checkpoint_config(dir / "doubling/step_9").moe.num_experts == 8);
  // A checkpoint whose experts are not the schedule's at its step is refused.
  auto c = test::run_mop("train --config " + late + ".yaml --set train.steps=12 --set "
                         "\"moe.growth=[{experts: 2, steps: 3}, {experts: 4, steps: 7}, {experts: 8}]\"");
  CHECK(c.code == 2);
  CHECK(c.output.find("has 8 experts per MoE layer; moe.growth has 4 at that step (stage 2 of 3)") != std::string::npos);
}
