// Optimizer step and LR schedules: clipping as torch's clip_grad_norm_, no decay on norms, a
// non-finite gradient names the first offending parameter and changes nothing, schedule shapes;
// host-placed state through the host pipeline after a skipped step.
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "catch.h"
#include "config/config.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
#include "schedule/host_pipeline.h"
#include "test_util.h"

using namespace mop;

namespace {

struct Setup {
  Config cfg = load_config_text(R"(
model: {vocab_size: 7, hidden_size: 4, num_layers: 1, num_heads: 2, num_kv_heads: 1, qk_norm: false}
moe: {num_experts: 2, top_k: 1, expert_ffn: 3}
data: {eos_id: 6}
optim: {lr: 0.1, weight_decay: 0.5, grad_clip: 1.0}
)");
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  std::unique_ptr<Ops> ops = make_cpu_ops();
  ParamStore params{layout, DType::F32, DType::F32, MemKind::Host};
  Optimizer optim{cfg.optim, params, *ops};
  Setup() { optim.init_weights(3); }
  std::vector<float> weights() {
    Tensor w = params.weights_flat();
    return std::vector<float>(w.ptr<float>(), w.ptr<float>() + w.numel());
  }
};

}  // namespace

TEST_CASE("optimizer: clipping, decay only on matrices, Adam's first step", "[cpu][optim]") {
  Setup s;
  // Every gradient element 1 → global norm sqrt(number of real elements).
  int64_t n = 0;
  for (int p = 0; p < s.params.num_params(); ++p) {
    s.ops->fill(s.params.grad(p), 1.0);
    n += s.params.grad(p).numel();
  }
  auto before = s.weights();
  StepReport r = s.optim.step(0.1f);
  REQUIRE(r.applied);
  CHECK(r.grad_norm == Approx(std::sqrt(double(n))).epsilon(1e-12));
  // Adam's first step moves each weight by lr·sign(g) (m̂/√v̂ = ±1 whatever the clip scale) plus
  // decoupled decay lr·wd·w on decayed parameters only.
  for (int p = 0; p < s.params.num_params(); ++p) {
    const auto& def = s.layout.params[p];
    Tensor w = s.params.weight(p);
    const float* w0 = before.data() + s.params.offset(p);
    for (int64_t i = 0; i < w.numel(); ++i) {
      double decay = def.decay ? 0.1 * 0.5 : 0.0;
      double expect = double(w0[i]) * (1 - decay) - 0.1;
      INFO(def.name << "[" << i << "]");
      CHECK(w.ptr<float>()[i] == Approx(expect).margin(1e-6));
    }
  }
  // Norm weights start at 1 and are never decayed.
  CHECK(s.params.weight(s.layout.final_norm).ptr<float>()[0] == Approx(0.9).margin(1e-6));
  CHECK(s.optim.updates() == 1);
}

TEST_CASE("optimizer: a non-finite gradient names the first parameter and changes nothing", "[cpu][optim]") {
  Setup s;
  for (int p = 0; p < s.params.num_params(); ++p) s.ops->fill(s.params.grad(p), 0.5);
  int victim = s.layout.layers[0].experts_down;
  s.params.grad(victim).ptr<float>()[5] = std::nanf("");
  s.params.grad(s.layout.lm_head).ptr<float>()[0] = INFINITY;  // a later one: not the first
  auto before = s.weights();
  StepReport r = s.optim.step(0.1f);
  CHECK_FALSE(r.applied);
  CHECK(r.nonfinite_param == "model.layers.0.mlp.experts.down_proj");
  CHECK(s.weights() == before);
  CHECK(s.optim.updates() == 0);
}

TEST_CASE("lr schedules: warmup, cosine, wsd, constant", "[cpu][optim]") {
  OptimConfig o;
  o.lr = 1.0, o.min_lr = 0.1, o.warmup_steps = 10;
  o.schedule = "cosine";
  CHECK(learning_rate(o, 0, 100) == Approx(0.1));
  CHECK(learning_rate(o, 9, 100) == Approx(1.0));
  CHECK(learning_rate(o, 10, 100) == Approx(1.0));
  CHECK(learning_rate(o, 99, 100) == Approx(0.1));
  double mid = learning_rate(o, 10 + 89 / 2, 100);
  CHECK(mid == Approx(0.55).margin(0.02));
  for (int s = 11; s < 100; ++s) CHECK(learning_rate(o, s, 100) <= learning_rate(o, s - 1, 100));
  o.schedule = "wsd";
  o.decay_fraction = 0.2;
  CHECK(learning_rate(o, 50, 100) == 1.0);
  CHECK(learning_rate(o, 79, 100) == 1.0);
  CHECK(learning_rate(o, 80, 100) < 1.0);
  CHECK(learning_rate(o, 99, 100) == Approx(0.1));
  o.schedule = "constant";
  CHECK(learning_rate(o, 99, 100) == 1.0);
}

TEST_CASE("optimizer: host-placed state after a skipped step updates with the next step's gradients",
          "[cpu][optim]") {
  // Host-placed parameters move their gradients aside as backward finishes each segment
  // (grads_final). A step skipped for a non-finite gradient must not leave those copies for the
  // next step: its update has to match the native optimizer's, bit for bit.
  Setup native;
  const int n = native.params.num_params();
  ParamStore params{native.layout, DType::F32, DType::F32, MemKind::Host};
  Optimizer host{native.cfg.optim, params, *native.ops, std::vector<bool>(size_t(n), true)};
  host.init_weights(3);
  REQUIRE(host.num_host_params() == n);
  auto pipeline = make_host_pipeline(*native.ops, host.host_params(), 2);
  const int victim = native.layout.layers[0].experts_down;
  auto step = [&](ParamStore& ps, Optimizer& o, bool poisoned) {
    for (int p = 0; p < n; ++p) native.ops->fill(ps.grad(p), (poisoned ? 0.75 : 0.25) + 0.01 * p);
    if (poisoned) ps.grad(victim).ptr<float>()[1] = std::nanf("");
    HostPipeline* pipe = &o == &host ? pipeline.get() : nullptr;
    if (pipe)
      for (int s = 0; s < num_segments(native.layout.dims); ++s) pipe->grads_final(s);
    const StepReport r = o.step(0.1f);
    if (pipe) pipe->finish_step(r, /*overlap=*/true), pipe->drain();
    return r.applied;
  };
  CHECK_FALSE(step(native.params, native.optim, true));
  CHECK_FALSE(step(params, host, true));
  CHECK(step(native.params, native.optim, false));
  CHECK(step(params, host, false));
  Tensor a = native.params.weights_flat(), b = params.weights_flat();
  REQUIRE(a.numel() == b.numel());
  int64_t differ = 0, nonfinite = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    differ += std::memcmp(a.ptr<float>() + i, b.ptr<float>() + i, sizeof(float)) != 0;
    nonfinite += !std::isfinite(b.ptr<float>()[i]);
  }
  CHECK(nonfinite == 0);
  CHECK(differ == 0);
}

