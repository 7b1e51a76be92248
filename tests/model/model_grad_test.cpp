// The whole model's gradient in float64: analytic backward (every parameter) against central
// finite differences of the full loss (cross-entropy + load-balancing + z-loss), on a tiny model
// with a dense first layer, a shared expert, q/k norm and GQA; recomputation gives bit-identical
// gradients; tied embeddings; the segment ranges the step program runs equal the whole pass.
#include <cmath>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "model/transformer.h"
#include "optim/optimizer.h"
#include "test_util.h"

using namespace mop;

namespace {

// Central differences with h = 1e-5 in fp64: truncation O(h²)·f''' ≈ 1e-10 relative to the
// O(1) loss, round-off ≈ 1e-16/1e-5 = 1e-11; agreement to 1e-6 of the gradient scale is safe.
constexpr double kFdStep = 1e-5;
constexpr double kFdTol = 1e-6;

const char* kTinyModel = R"(
model: {vocab_size: 11, hidden_size: 8, num_layers: 3, num_heads: 4, num_kv_heads: 2, head_dim: 4,
        rope_theta: 100, qk_norm: true, init_std: 0.5}
moe: {num_experts: 5, top_k: 2, expert_ffn: 6, shared_expert_ffn: 4, first_dense_layers: 1,
      dense_ffn: 6, aux_loss_coef: 0.1, z_loss_coef: 0.05}
data: {eos_id: 10, seq_len: 5}
train: {micro_batch_size: 2, global_batch_size: 2}
)";

struct Fixture {
  Config cfg;
  ModelLayout layout;
  std::unique_ptr<Ops> ops = make_cpu_ops();
  std::unique_ptr<ParamStore> params;
  std::unique_ptr<Optimizer> optim;
  std::unique_ptr<Transformer> model;
  std::vector<int32_t> ids, targets, pos;
  double ce_scale = 0;

  Fixture(const std::string& yaml, bool recompute, int64_t moe_chunk = 0) {
    cfg = load_config_text(yaml);
    layout = ModelLayout::build(ModelDims::from(cfg));
    params = std::make_unique<ParamStore>(layout, DType::F64, DType::F64, MemKind::Host);
    optim = std::make_unique<Optimizer>(cfg.optim, *params, *ops);
    optim->init_weights(7);
    TransformerOptions o;
    o.plan.max_batch = 2, o.plan.max_seq = 5, o.plan.recompute = recompute, o.plan.lm_head_chunk = 3;
    o.plan.moe_chunk = moe_chunk;
    model = std::make_unique<Transformer>(layout, *params, *ops, o);
    model->allocate();
    ids = {1, 4, 9, 2, 2, 7, 0, 3, 10, 5};
    targets = {4, 9, 2, 2, -1, 0, 3, 10, 5, 6};  // one masked target
    pos = {0, 1, 2, 3, 4, 0, 1, 2, 3, 4};
    ce_scale = 1.0 / 9.0;
  }
  Batch batch() {
    return {2, 5, Tensor(ids.data(), DType::I32, {10}), Tensor(targets.data(), DType::I32, {10}),
            Tensor(pos.data(), DType::I32, {10})};
  }
  double loss() {
    model->forward(batch(), 1.0f);
    LossTerms t = model->take_losses();
    return ce_scale * t.ce_sum + t.aux + t.z;
  }
  void backward() {
    ops->fill(params->grads_flat(), 0);
    model->forward_backward(batch(), float(ce_scale), 1.0f);
    model->take_losses();
  }
};

void check_gradients(Fixture& f) {
  f.backward();
  int checked = 0;
  for (int p = 0; p < f.params->num_params(); ++p) {
    Tensor w = f.params->weight(p), g = f.params->grad(p);
    const int64_t n = w.numel();
    // Up to 12 elements per parameter, spread over the tensor (every expert's block gets some).
    int64_t stride = std::max<int64_t>(1, n / 12);
    double gmax = 0;
    for (int64_t i = 0; i < n; ++i) gmax = std::max(gmax, std::fabs(g.ptr<double>()[i]));
    for (int64_t i = 0; i < n; i += stride) {
      double& x = w.ptr<double>()[i];
      double keep = x;
      x = keep + kFdStep;
      double lp = f.loss();
      x = keep - kFdStep;
      double lm = f.loss();
      x = keep;
      double fd = (lp - lm) / (2 * kFdStep);
      double an = g.ptr<double>()[i];
      INFO(f.layout.params[p].name << "[" << i << "]: analytic " << an << ", finite difference " << fd);
      CHECK(std::fabs(an - fd) <= kFdTol * std::max(1.0, gmax));
      ++checked;
    }
    INFO(f.layout.params[p].name);
    CHECK(gmax > 0);  // every parameter receives gradient
  }
  CHECK(checked > 200);
}

}  // namespace

TEST_CASE("model: whole-model gradient matches finite differences (fp64)", "[cpu][model]") {
  Fixture f(kTinyModel, /*recompute=*/false);
  double l = f.loss();
  CHECK(std::isfinite(l));
  CHECK(l > 1.0);  // ≈ ln(11) for a random model
  check_gradients(f);
}

TEST_CASE("model: tied embeddings, no qk norm, no shared expert", "[cpu][model]") {
  Fixture f(R"(
model: {vocab_size: 11, hidden_size: 8, num_layers: 2, num_heads: 2, num_kv_heads: 2, head_dim: 4,
        qk_norm: false, tie_embeddings: true, init_std: 0.5}
moe: {num_experts: 4, top_k: 4, expert_ffn: 3, renormalize: false, aux_loss_coef: 0.1, z_loss_coef: 0.05}
data: {eos_id: 10, seq_len: 5}
train: {micro_batch_size: 2, global_batch_size: 2}
)", false);
  CHECK(f.layout.lm_head == f.layout.embedding);
  check_gradients(f);
}

TEST_CASE("model: recomputation gives bit-identical loss and gradients", "[cpu][model]") {
  Fixture a(kTinyModel, false), b(kTinyModel, true);
  a.backward();
  b.backward();
  Tensor ga = a.params->grads_flat(), gb = b.params->grads_flat();
  REQUIRE(ga.numel() == gb.numel());
  int64_t differ = 0;
  for (int64_t i = 0; i < ga.numel(); ++i) differ += ga.ptr<double>()[i] != gb.ptr<double>()[i];
  CHECK(differ == 0);
  CHECK(a.loss() == b.loss());
}

TEST_CASE("model: the first micro-batch writes the experts' gradients, the bits of adding to zeros",
          "[cpu][model]") {
  // Two micro-batches: a zeroes every gradient and adds both; b leaves NaN in the routed experts'
  // gradients (what the step no longer zeroes) and lets the first micro-batch write them. Whole
  // MoE blocks, token chunks of 4 (the first chunk writes, the others add), and recomputation.
  for (auto [recompute, chunk] : {std::pair{false, int64_t(0)}, {false, int64_t(4)}, {true, int64_t(4)}}) {
    INFO("recompute " << recompute << ", MoE chunk " << chunk);
    Fixture a(kTinyModel, recompute, chunk), b(kTinyModel, recompute, chunk);
    a.ops->fill(a.params->grads_flat(), 0);
    b.ops->fill(b.params->grads_flat(), 0);
    int experts = 0;
    for (int p = 0; p < b.params->num_params(); ++p)
      if (b.model->writes_gradient(p)) {
        b.ops->fill(b.params->grad(p), std::numeric_limits<double>::quiet_NaN());
        ++experts;
      }
    CHECK(experts == 4);  // gate_up and down of the two MoE layers
    for (int m = 0; m < 2; ++m) {
      a.model->forward_backward(a.batch(), float(a.ce_scale), 0.5f);
      b.model->forward_backward(b.batch(), float(b.ce_scale), 0.5f, /*write_experts=*/m == 0);
    }
    CHECK(a.model->take_losses().ce_sum == b.model->take_losses().ce_sum);
    Tensor ga = a.params->grads_flat(), gb = b.params->grads_flat();
    REQUIRE(ga.numel() == gb.numel());
    CHECK(std::memcmp(ga.data, gb.data, ga.bytes()) == 0);
  }
}

TEST_CASE("model: forward and backward over segment ranges equal the whole pass, bit for bit",
          "[cpu][model]") {
  // The step program calls the model a range of segments at a time; any split of the 5 segments
  // (embedding, 3 layers, head) gives the whole pass's losses and gradients — with recomputation
  // and its one-layer-ahead refills too, and across two micro-batches (the second adds).
  const std::vector<std::vector<int>> splits = {{0, 5}, {0, 1, 2, 3, 4, 5}, {0, 2, 5}, {0, 4, 5}};
  for (bool recompute : {false, true})
    for (const std::vector<int>& cut : splits) {
      INFO("recompute " << recompute << ", " << cut.size() - 1 << " ranges");
      Fixture whole(kTinyModel, recompute, 4), parts(kTinyModel, recompute, 4);
      whole.ops->fill(whole.params->grads_flat(), 0);
      parts.ops->fill(parts.params->grads_flat(), 0);
      for (int m = 0; m < 2; ++m) {
        whole.model->forward_backward(whole.batch(), float(whole.ce_scale), 0.5f, m == 0);
        const Transformer::Pass p = parts.model->begin(parts.batch(), 0.5f, true, float(parts.ce_scale), m == 0);
        for (size_t i = 0; i + 1 < cut.size(); ++i) parts.model->forward(p, cut[i], cut[i + 1]);
        for (size_t i = cut.size() - 1; i > 0; --i) parts.model->backward(p, cut[i - 1], cut[i]);
      }
      const LossTerms a = whole.model->take_losses(), b = parts.model->take_losses();
      CHECK(a.ce_sum == b.ce_sum);
      CHECK(a.aux == b.aux);
      CHECK(a.z == b.z);
      Tensor ga = whole.params->grads_flat(), gb = parts.params->grads_flat();
      REQUIRE(ga.numel() == gb.numel());
      CHECK(std::memcmp(ga.data, gb.data, ga.bytes()) == 0);
      CHECK(a.ce_sum > 0);
    }
  Fixture f(kTinyModel, false);
  const Transformer::Pass p = f.model->begin(f.batch(), 1.0f, /*training=*/false);
  CHECK_THROWS_WITH(f.model->backward(p, 0, 5), Catch::Contains("without training"));
  CHECK_THROWS_WITH(f.model->forward(p, 2, 6), Catch::Contains("forward of segments [2,6)"));
}

TEST_CASE("model: parameter names follow the Qwen3-MoE checkpoints", "[cpu][model]") {
  Config cfg = load_config_text(kTinyModel);
  ModelLayout layout = ModelLayout::build(ModelDims::from(cfg));
  std::vector<std::string> names;
  for (const auto& v : layout.hf_views()) names.push_back(v.name);
  auto has = [&](const std::string& n) { return std::find(names.begin(), names.end(), n) != names.end(); };
  CHECK(has("model.embed_tokens.weight"));
  CHECK(has("model.layers.0.mlp.gate_proj.weight"));  // dense first layer
  CHECK(has("model.layers.1.self_attn.q_norm.weight"));
  CHECK(has("model.layers.1.mlp.gate.weight"));
  CHECK(has("model.layers.2.mlp.experts.4.down_proj.weight"));
  CHECK(has("model.layers.2.mlp.experts.0.up_proj.weight"));
  CHECK(has("model.layers.2.mlp.shared_expert.gate_proj.weight"));
  CHECK(has("model.norm.weight"));
  CHECK(has("lm_head.weight"));
  // Views tile every parameter exactly once.
  int64_t covered = 0;
  for (const auto& v : layout.hf_views()) {
    int64_t n = 1;
    for (auto s : v.shape) n *= s;
    covered += n;
  }
  CHECK(covered == layout.num_params());
  // q3moe-8l's active parameter count (the one-GPU issue): 766M without the embedding.
  Config q = load_config_text(R"(
model: {vocab_size: 151936, hidden_size: 2048, num_layers: 8, num_heads: 32, num_kv_heads: 4, head_dim: 128}
moe: {num_experts: 128, top_k: 8, expert_ffn: 768}
)");
  ModelLayout ql = ModelLayout::build(ModelDims::from(q));
  CHECK(std::llround(ql.num_active_params() / 1e6) == 766);
  CHECK(std::llround(ql.num_params() / 1e8) == 56);  // 5.6B
}
