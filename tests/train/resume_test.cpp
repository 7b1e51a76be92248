// End to end through the `mop` binary: 2N steps straight and N steps + exit + resume + N steps
// give bit-identical losses at every step and byte-identical final weights and optimizer state;
// a corrupted checkpoint is refused with exit code 2; a stop signal during start-up (in process)
// ends the run before its first step.
#include <csignal>
#include <filesystem>
#include <fstream>

#include "catch.h"
#include "ckpt/manifest.h"
#include "data/prepare_data.h"
#include "config/config.h"
#include "runtime/comm.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

std::string tiny_config(const std::string& data, const std::string& ckpt, int steps) {
  return R"(
model: {vocab_size: 257, hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 4, top_k: 2, expert_ffn: 16, shared_expert_ffn: 8, aux_loss_coef: 0.01, z_loss_coef: 0.001}
optim: {lr: 0.01, min_lr: 0.001, warmup_steps: 2}
data: {paths: [)" + data + R"(], seq_len: 16, eod_mask_loss: true, valid_fraction: 0.05}
train: {steps: )" + std::to_string(steps) + R"(, global_batch_size: 6, micro_batch_size: 3, seed: 5, eval_interval: 3, eval_batches: 2}
checkpoint: {dir: )" + ckpt + R"(, interval: 2, keep_last: 0, resume: auto}
log: {interval: 1}
)";
}

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("train: N steps + resume + N steps equals 2N steps bit for bit", "[cpu][train]") {
  test::TempDir dir;
  test::write_text(dir / "corpus.txt", test::sample_corpus(60000));
  PrepareDataOptions po;
  po.inputs = {dir / "corpus.txt"};
  po.output = dir / "corpus";
  po.split = DocSplit::BlankLine;
  prepare_data(po);
  const int N = 5;

  test::write_text(dir / "straight.yaml", tiny_config(dir / "corpus", dir / "straight", 2 * N));
  auto straight = test::run_mop("train --config " + dir / "straight.yaml");
  INFO(straight.output);
  REQUIRE(straight.code == 0);

  // Same config, but the first process exits after step N (train.exit_interval), the second
  // resumes from the latest checkpoint.
  test::write_text(dir / "split.yaml", tiny_config(dir / "corpus", dir / "split", 2 * N));
  auto first = test::run_mop("train --config " + dir / "split.yaml" + " --set train.exit_interval=" + std::to_string(N));
  INFO(first.output);
  REQUIRE(first.code == 0);
  CHECK(first.output.find("exiting at step 5") != std::string::npos);
  auto second = test::run_mop("train --config " + dir / "split.yaml");
  INFO(second.output);
  REQUIRE(second.code == 0);
  CHECK(second.output.find("resumed from") != std::string::npos);

  auto a = test::read_metrics(dir / "straight/metrics.jsonl");
  auto b = test::read_metrics(dir / "split/metrics.jsonl");
  REQUIRE(a.size() == size_t(2 * N));
  REQUIRE(b.size() == size_t(2 * N));
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(a[i].at("step").as_int64() == int64_t(i + 1));
    CHECK(b[i].at("step").as_int64() == int64_t(i + 1));
    // Shortest round-trip text: equal strings ⇔ equal doubles, bit for bit.
    CHECK(a[i].at("loss").dump() == b[i].at("loss").dump());
    CHECK(a[i].at("aux_loss").dump() == b[i].at("aux_loss").dump());
    CHECK(a[i].at("grad_norm").dump() == b[i].at("grad_norm").dump());
    if (a[i].find("val_loss")) CHECK(a[i].at("val_loss").dump() == b[i].at("val_loss").dump());
  }
  // The loss moves (the test could not pass with a frozen model).
  CHECK(a.front().at("loss").as_double() != a.back().at("loss").as_double());
  // Final weights and Adam moments identical to the byte.
  std::string last = "step_" + std::to_string(2 * N);
  CHECK(file_bytes(dir / ("straight/" + last + "/model.safetensors")) ==
        file_bytes(dir / ("split/" + last + "/model.safetensors")));
  CHECK(file_bytes(dir / ("straight/" + last + "/optimizer.safetensors")) ==
        file_bytes(dir / ("split/" + last + "/optimizer.safetensors")));

  // A flipped byte in a checkpoint: refused, exit code 2, naming the file.
  std::string victim = dir / ("split/" + last + "/model.safetensors");
  {
    std::fstream f(victim, std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  auto corrupt = test::run_mop("train --config " + dir / "split.yaml" + " --set train.steps=12");
  CHECK(corrupt.code == 2);
  CHECK(corrupt.output.find("model.safetensors: SHA-256 mismatch") != std::string::npos);
}

TEST_CASE("train: a stop signal during start-up ends the run before its first step",
          "[cpu][train]") {
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 20000);
  const Config cfg = load_config_text(tiny_config(corpus, dir / "ckpt", 4));
  World w;
  w.comm = make_self_comm();
  {
    // What `mop train` does from its first line: the handlers, then (here at once) the signal.
    StopSignals signals;
    std::raise(SIGTERM);
    Trainer t(cfg, w);
    t.run();
    CHECK(t.step() == 0);
    CHECK_FALSE(std::filesystem::exists(dir / "ckpt/latest"));
  }
  // The next run (no signal) trains to the end.
  StopSignals again;
  Trainer u(cfg, w);
  u.run();
  CHECK(u.step() == 4);
}
