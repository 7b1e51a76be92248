// Optimizer state in pinned host memory on a GPU run: overlapped with the next forward or not,
// the losses, weights and moments are the same bit for bit (and so with the state on the GPU,
// its AdamW on a stream of its own); a mixed placement (auto with a small
// GPU share is not forced here) runs through the same pipeline.
#ifdef MOP_HAVE_CUDA

#include <cuda_runtime.h>

#include <cmath>
#include <cstring>
#include <fstream>

#include "catch.h"
#include "config/config.h"
#include "runtime/cuda_check.h"
#include "data/prepare_data.h"
#include "gpu/gpu_test_util.h"
#include "ops/cuda_ops.h"
#include "schedule/host_pipeline.h"
#include "train/train_test_util.h"

using namespace mop;

namespace {
std::string file_bytes(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}
}  // namespace

namespace {

// Trains a small MoE 8 steps on the GPU with `optim` and `extra` settings, once with
// optim.overlap: false and once overlapped; every step's loss and gradient norm and both
// checkpoints' weights and optimizer state must be the same bit for bit. Returns the overlapped
// run's output.
std::string expect_overlap_equals_plain(const std::string& optim, const std::string& extra) {
  test::TempDir dir;
  test::prepare_corpus(dir, 200000);
  test::write_text(dir / "cfg.yaml", R"(
model: {vocab_size: 257, hidden_size: 64, num_layers: 3, num_heads: 4, num_kv_heads: 2, head_dim: 16}
moe: {num_experts: 8, top_k: 2, expert_ffn: 64, first_dense_layers: 1, dense_ffn: 96}
optim: {lr: 0.003, min_lr: 0.0003, warmup_steps: 2, grad_clip: 0.5, )" + optim + R"(}
data: {paths: [)" + dir / "corpus" + R"(], seq_len: 64, valid_fraction: 0.05}
train: {steps: 8, global_batch_size: 8, micro_batch_size: 4, device: cuda)" + extra + R"(}
checkpoint: {interval: 4, keep_last: 0}
log: {interval: 2}
)");
  const std::string cfg = "train --config " + dir / "cfg.yaml";
  auto plain = test::run_mop(cfg + " --set optim.overlap=false --set checkpoint.dir=" + dir / "plain");
  INFO(plain.output);
  REQUIRE(plain.code == 0);
  auto overlap = test::run_mop(cfg + " --set checkpoint.dir=" + dir / "overlap");
  INFO(overlap.output);
  REQUIRE(overlap.code == 0);
  auto a = test::read_metrics(dir / "plain/metrics.jsonl"), b = test::read_metrics(dir / "overlap/metrics.jsonl");
  REQUIRE(a.size() == 8);
  REQUIRE(b.size() == 8);
  for (size_t i = 0; i < a.size(); ++i) {
    INFO("step " << i + 1);
    CHECK(a[i].at("loss").dump() == b[i].at("loss").dump());
    CHECK(a[i].at("grad_norm").dump() == b[i].at("grad_norm").dump());
  }
  CHECK(a.front().at("loss").as_double() > a.back().at("loss").as_double());
  for (const char* step : {"step_4/", "step_8/"})
    for (const char* f : {"model.safetensors", "optimizer.safetensors"})
      CHECK(file_bytes(dir / ("plain/" + std::string(step) + f)) ==
            file_bytes(dir / ("overlap/" + std::string(step) + f)));
  return overlap.output;
}

}  // namespace

TEST_CASE("gpu training: host optimizer overlapped equals plain bit for bit", "[gpu][train]") {
  const std::string out = expect_overlap_equals_plain("state_placement: host", "");
  CHECK(out.find("host optimizer per step") != std::string::npos);
}

TEST_CASE("gpu training: the device AdamW overlapped with the next forward equals plain bit for bit",
          "[gpu][train]") {
  // With evaluations between steps (a forward outside the step reads the overlapped weights).
  expect_overlap_equals_plain("state_placement: gpu", ", eval_interval: 3, eval_batches: 1");
}

TEST_CASE("gpu optimizer: host-placed state after a skipped step updates with the next step's gradients",
          "[gpu][optim]") {
  if (!test::gpu_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  // Each segment's gradients go to the host as backward finishes them (grads_final); a step skipped
  // for a non-finite gradient must not leave them for the next one. Skip-then-step has to give the
  // weights of the good step alone, bit for bit.
  Config cfg = load_config_text(R"(
model: {vocab_size: 64, hidden_size: 32, num_layers: 2, num_heads: 2, num_kv_heads: 1, head_dim: 16}
moe: {num_experts: 4, top_k: 2, expert_ffn: 32}
data: {eos_id: 63}
optim: {lr: 0.1, weight_decay: 0.5, grad_clip: 1.0}
)");
  const ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  CudaOps ops;
  const int n = int(layout.params.size()), segments = num_segments(layout.dims);
  auto run = [&](bool skip_first) {
    ParamStore params{layout, DType::BF16, DType::F32, MemKind::Device};
    Optimizer o{cfg.optim, params, ops, std::vector<bool>(size_t(n), true)};
    o.init_weights(3);
    auto pipeline = make_host_pipeline(ops, o.host_params(), 2);
    auto step = [&](bool poisoned) {
      for (int p = 0; p < n; ++p) ops.fill(params.grad(p), (poisoned ? 0.75 : 0.25) + 0.01 * p);
      if (poisoned) {
        const float nan = std::nanf("");
        MOP_CUDA_CHECK(cudaMemcpyAsync(params.grad(layout.layers[0].experts_down).data, &nan,
                                       sizeof nan, cudaMemcpyHostToDevice, ops.cuda_stream()));
      }
      for (int s = 0; s < segments; ++s) pipeline->grads_final(s);
      const StepReport r = o.step(0.1f);
      pipeline->finish_step(r, /*overlap=*/true);
      pipeline->drain();
      return r.applied;
    };
    if (skip_first) CHECK_FALSE(step(true));
    CHECK(step(false));
    ops.synchronize();
    return test::download(params.weights_flat());
  };
  test::HostTensor skipped = run(true), straight = run(false);
  REQUIRE(skipped.t.bytes() == straight.t.bytes());
  int64_t nonfinite = 0;
  for (int64_t i = 0; i < skipped.t.numel(); ++i) nonfinite += !std::isfinite(skipped.get(i));
  CHECK(nonfinite == 0);
  CHECK(std::memcmp(skipped.t.data, straight.t.data, skipped.t.bytes()) == 0);
}

#endif  // MOP_HAVE_CUDA
