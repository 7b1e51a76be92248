// Optimizer state in pinned host memory on a GPU run: overlapped with the next forward or not,
// the losses, weights and moments are the same bit for bit; a mixed placement (auto with a small
// GPU share is not forced here) runs through the same pipeline.
#ifdef MOP_HAVE_CUDA

#include <fstream>

#include "catch.h"
#include "data/prepare_data.h"
#include "gpu/gpu_test_util.h"
#include "train/train_test_util.h"

using namespace mop;

namespace {
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

TEST_CASE("gpu training: host optimizer overlapped equals plain bit for bit", "[gpu][train]") {
  test::TempDir dir;
  test::write_text(dir / "corpus.txt", test::sample_corpus(200000));
  PrepareDataOptions po;
  po.inputs = {dir / "corpus.txt"};
  po.output = dir / "corpus";
  prepare_data(po);
  test::write_text(dir / "cfg.yaml", R"(
model: {vocab_size: 257, hidden_size: 64, num_layers: 3, num_heads: 4, num_kv_heads: 2, head_dim: 16}
moe: {num_experts: 8, top_k: 2, expert_ffn: 64, first_dense_layers: 1, dense_ffn: 96}
optim: {lr: 0.003, min_lr: 0.0003, warmup_steps: 2, grad_clip: 0.5}
data: {paths: [)" + dir / "corpus" + R"(], seq_len: 64}
train: {steps: 8, global_batch_size: 8, micro_batch_size: 4, device: cuda}
checkpoint: {interval: 4, keep_last: 0}
log: {interval: 2}
)");
  const std::string cfg = "train --config " + dir / "cfg.yaml" + " --set optim.state_placement=host";
  auto plain = test::run_mop(cfg + " --set optim.overlap=false --set checkpoint.dir=" + dir / "plain");
  INFO(plain.output);
  REQUIRE(plain.code == 0);
  auto overlap = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "overlap");
  INFO(overlap.output);
  REQUIRE(overlap.code == 0);
  CHECK(overlap.output.find("host optimizer per step") != std::string::npos);
  auto a = test::read_metrics(dir / "plain/metrics.jsonl"), b = test::read_metrics(dir / "overlap/metrics.jsonl");
  REQUIRE(a.size() == 8);
  REQUIRE(b.size() == 8);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(a[i].at("loss").dump() == b[i].at("loss").dump());
    CHECK(a[i].at("grad_norm").dump() == b[i].at("grad_norm").dump());
  }
  CHECK(a.front().at("loss").as_double() > a.back().at("loss").as_double());
  for (const char* f : {"model.safetensors", "optimizer.safetensors"})
    CHECK(file_bytes(dir / ("plain/step_8/" + std::string(f))) == file_bytes(dir / ("overlap/step_8/" + std::string(f))));
}

#endif  // MOP_HAVE_CUDA
