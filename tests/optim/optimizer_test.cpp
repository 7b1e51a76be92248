// Optimizer step and LR schedules: clipping as torch's clip_grad_norm_, no decay on norms, a
// non-finite gradient names the first offending parameter and changes nothing, schedule shapes.
#include <cmath>

#include "catch.h"
#include "config/config.h"
#include "optim/optimizer.h"
#include "optim/schedule.h"
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
