// Optimizer state on the host (CPU runs): the host engine, plain or overlapped with the next
// forward, gives the same losses at every step and the same final weights and moments, byte for
// byte, as the backend's own AdamW (itself overlapped on an Ops of its own, or not) — and resuming
// a host-placed run continues bit for bit.
#include <fstream>

#include "catch.h"
#include "data/prepare_data.h"
#include "train/train_test_util.h"

using namespace mop;

namespace {

std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

}  // namespace

TEST_CASE("train: host optimizer (plain and overlapped) equals the backend's AdamW bit for bit", "[cpu][train]") {
  test::TempDir dir;
  test::prepare_corpus(dir, 50000);
  test::write_text(dir / "cfg.yaml", R"(
model: {vocab_size: 257, hidden_size: 16, num_layers: 3, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 4, top_k: 2, expert_ffn: 16, first_dense_layers: 1, dense_ffn: 24}
optim: {lr: 0.01, min_lr: 0.001, warmup_steps: 2, grad_clip: 0.5}
data: {paths: [)" + dir / "corpus" + R"(], seq_len: 16, valid_fraction: 0.05}
train: {steps: 6, global_batch_size: 6, micro_batch_size: 2, eval_interval: 3, eval_batches: 1}
checkpoint: {interval: 3, keep_last: 0}
log: {interval: 1}
)");
  const std::string cfg = "train --config " + dir / "cfg.yaml";
  auto native = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "native");
  INFO(native.output);
  REQUIRE(native.code == 0);
  // The backend's AdamW overlapped with the next forward (the default above) and not.
  auto native_plain = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "native_plain" +
                                    " --set optim.overlap=false");
  INFO(native_plain.output);
  REQUIRE(native_plain.code == 0);
  auto plain = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "plain" +
                             " --set optim.state_placement=host --set optim.overlap=false");
  INFO(plain.output);
  REQUIRE(plain.code == 0);
  CHECK(plain.output.find("on the host") != std::string::npos);
  // Overlapped, and interrupted after step 3 then resumed (host state saved and restored).
  auto first = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "overlap" +
                             " --set optim.state_placement=host --set train.exit_interval=3");
  INFO(first.output);
  REQUIRE(first.code == 0);
  auto second = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "overlap" +
                              " --set optim.state_placement=host --set checkpoint.resume=auto");
  INFO(second.output);
  REQUIRE(second.code == 0);

  auto a = test::read_metrics(dir / "native/metrics.jsonl");
  // The overlapped update's time on its own stream, from step 2 on (step 1's update runs during
  // step 2); none without the overlap.
  CHECK(native.output.find("update stream") != std::string::npos);
  CHECK(native_plain.output.find("update stream") == std::string::npos);
  REQUIRE(a.size() == 6);
  CHECK(a[0].find("update_stream_seconds") == nullptr);
  for (size_t i = 1; i < a.size(); ++i) CHECK(a[i].at("update_stream_seconds").as_double() > 0);
  for (const char* run : {"native_plain", "plain", "overlap"}) {
    auto b = test::read_metrics(dir / (std::string(run) + "/metrics.jsonl"));
    INFO(run);
    REQUIRE(a.size() == 6);
    REQUIRE(b.size() == 6);
    for (size_t i = 0; i < a.size(); ++i) {
      CHECK(a[i].at("loss").dump() == b[i].at("loss").dump());
      CHECK(a[i].at("grad_norm").dump() == b[i].at("grad_norm").dump());
    }
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      CHECK(file_bytes(dir / ("native/step_6/" + std::string(f))) ==
            file_bytes(dir / (std::string(run) + "/step_6/" + f)));
  }
  CHECK(a.front().at("loss").as_double() != a.back().at("loss").as_double());
}
