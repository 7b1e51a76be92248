// A pipeline stage's parameter store (model/params.h: ParamStore's `segments`): it holds the
// parameters of its segments only — their weights, gradients, slices and gather slots take the
// room of those parameters alone, the others none, and asking for another stage's is an internal
// error. The optimizer over such a store starts the held parameters at the values the whole
// model's store gives them, and its gradient norm counts the stage's parameters only.
#include <cmath>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "model/params.h"
#include "optim/optimizer.h"
#include "test_util.h"

using namespace mop;

namespace {

// 3 layers (the first dense), 4 experts: segments 0 embedding, 1..3 layers, 4 head.
const char* kModel = R"(
model: {vocab_size: 13, hidden_size: 8, num_layers: 3, num_heads: 2, num_kv_heads: 1, head_dim: 4}
moe: {num_experts: 4, top_k: 2, expert_ffn: 6, first_dense_layers: 1, dense_ffn: 6}
data: {eos_id: 12, seq_len: 5}
)";

ModelLayout layout_of() { return ModelLayout::build(ModelDims::from(load_config_text(kModel))); }

// Layers 1 and 2 (segments 2, 3): neither the embedding nor the head.
const std::vector<bool> kMiddle{false, false, true, true, false};

int64_t held_elements(const ModelLayout& layout, const std::vector<bool>& segments) {
  int64_t n = 0;
  for (int p = 0; p < int(layout.params.size()); ++p)
    if (segments[size_t(param_segment(layout, p))]) n += aligned_numel(layout.params[size_t(p)].numel());
  return n;
}

}  // namespace

TEST_CASE("stage store: only the stage's parameters take room; another stage's are refused", "[cpu][model][pipeline]") {
  const ModelLayout layout = layout_of();
  const ParamStore whole(layout, DType::F32, DType::F32, MemKind::Host);
  const ParamStore stage(layout, DType::F32, DType::F32, MemKind::Host, true, kMiddle);
  const int64_t mine = held_elements(layout, kMiddle);
  REQUIRE(mine > 0);
  CHECK(mine < whole.total_elements());
  CHECK(stage.total_elements() == mine);
  CHECK(stage.weight_bytes() == size_t(mine) * 4);
  CHECK(stage.grad_bytes() == size_t(mine) * 4);
  int held = 0;
  for (int p = 0; p < stage.num_params(); ++p) {
    const bool in = kMiddle[size_t(param_segment(layout, p))];
    CHECK(stage.held(p) == in);
    CHECK(whole.held(p));
    if (in) {
      ++held;
      CHECK(stage.weight(p).numel() == layout.params[size_t(p)].numel());
      CHECK(stage.grad(p).numel() == layout.params[size_t(p)].numel());
    } else {
      CHECK_THROWS(stage.weight(p));
      CHECK_THROWS(stage.grad(p));
    }
  }
  CHECK(held > 0);
  CHECK(held < stage.num_params());
  // A segment list of the wrong length is an internal error.
  CHECK_THROWS(ParamStore(layout, DType::F32, DType::F32, MemKind::Host, true, std::vector<bool>{true, false}));
}

TEST_CASE("stage store: sliced and streamed stores size slices and slots from the stage's segments", "[cpu][model][pipeline]") {
  const ModelLayout layout = layout_of();
  const int n = int(layout.params.size());
  ParamSlices slices;
  slices.n.assign(size_t(n), 2), slices.index.assign(size_t(n), 1);
  slices.allocate = false;
  const ParamStore stage(layout, DType::F32, DType::F32, MemKind::Host, slices, kMiddle);
  // Its slices, and two shared slots of its largest segment (both padded to whole slices).
  int64_t own = 0;
  std::vector<int64_t> group(5, 0);
  for (int p = 0; p < n; ++p) {
    const int s = param_segment(layout, p);
    if (!kMiddle[size_t(s)]) {
      CHECK(stage.slice_numel(p) == 0);
      CHECK_THROWS(stage.slice_weight(p));
      continue;
    }
    const int64_t k = slice_numel(layout.params[size_t(p)].numel(), 2);
    CHECK(stage.slice_numel(p) == k);
    own += aligned_numel(k);
    group[size_t(s)] += aligned_numel(2 * k);
  }
  const int64_t slot = std::max(group[2], group[3]);
  CHECK(stage.weight_bytes() == size_t(own + 2 * slot) * 4);
  const ParamStore whole(layout, DType::F32, DType::F32, MemKind::Host, slices);
  CHECK(stage.weight_bytes() < whole.weight_bytes());

  // Streamed gradients of segments 1 and 3: the stage's resident ones are layer 2's.
  const std::vector<bool> streamed{false, true, false, true, false};
  const ParamStore pooled(layout, DType::F32, DType::F32, MemKind::Host, PooledGrads{streamed, false}, kMiddle);
  int64_t resident = 0, layer3 = 0;
  for (int p = 0; p < n; ++p) {
    const int s = param_segment(layout, p);
    if (s == 2) resident += aligned_numel(layout.params[size_t(p)].numel());
    if (s == 3) layer3 += aligned_numel(layout.params[size_t(p)].numel());
  }
  CHECK(pooled.weight_bytes() == size_t(held_elements(layout, kMiddle)) * 4);
  CHECK(pooled.grad_bytes() == size_t(resident + 2 * layer3) * 4);
}

TEST_CASE("stage store: the optimizer starts the stage's weights as the whole store does; its norm is the stage's", "[cpu][model][pipeline][optim]") {
  const Config cfg = load_config_text(kModel);
  const ModelLayout layout = layout_of();
  auto ops = make_cpu_ops();
  ParamStore whole(layout, DType::F32, DType::F32, MemKind::Host);
  ParamStore stage(layout, DType::F32, DType::F32, MemKind::Host, true, kMiddle);
  std::vector<bool> owned(layout.params.size());
  for (int p = 0; p < int(owned.size()); ++p) owned[size_t(p)] = kMiddle[size_t(param_segment(layout, p))];
  Optimizer a(cfg.optim, whole, *ops), b(cfg.optim, stage, *ops, {}, owned);
  a.init_weights(3), b.init_weights(3);
  double stage_sumsq = 0;
  for (int p = 0; p < stage.num_params(); ++p) {
    const Tensor w = whole.weight(p);
    ops->fill(whole.grad(p), 0.25);
    if (!stage.held(p)) continue;
    const Tensor v = stage.weight(p);
    REQUIRE(v.numel() == w.numel());
    CHECK(std::equal(static_cast<const float*>(w.data), static_cast<const float*>(w.data) + w.numel(),
                     static_cast<const float*>(v.data)));
    ops->fill(stage.grad(p), 0.25);
    stage_sumsq += 0.0625 * double(w.numel());
  }
  const StepReport rs = b.step(1e-3f, false);
  REQUIRE(rs.nonfinite_param.empty());
  CHECK(rs.grad_norm == Approx(std::sqrt(stage_sumsq)).epsilon(1e-12));
  const StepReport rw = a.step(1e-3f, false);
  CHECK(rw.grad_norm > rs.grad_norm);
}
