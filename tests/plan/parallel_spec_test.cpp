// The parallel spec: each parameter's replica axes, and ZeRO-1 owners — exactly one owner per copy
// of every parameter (dense: one rank of the world; experts: one rank of each edp group), the
// loads balanced to within the largest parameter, and no owners without ZeRO or on one rank.
#include <algorithm>

#include "catch.h"
#include "config/config.h"
#include "plan/parallel_spec.h"

using namespace mop;

namespace {

ModelLayout tiny_layout(int ep) {
  const Config cfg = load_config_text(R"(
model: {vocab_size: 64, hidden_size: 16, num_layers: 3, num_heads: 4, num_kv_heads: 2}
moe: {num_experts: 8, top_k: 2, expert_ffn: 24, first_dense_layers: 1, dense_ffn: 32}
data: {eos_id: 63}
)");
  return ModelLayout::build(ModelDims::from(cfg, 0, ep));
}

MeshDims dims(int cp, int dp, int ep, int edp) {
  MeshDims d;
  d.cp = cp, d.dp = dp, d.ep = ep, d.edp = edp;
  return d;
}

}  // namespace

TEST_CASE("parallel spec: ZeRO-1 gives each copy of a parameter one owner, loads balanced",
          "[cpu][plan]") {
  struct Mesh {
    int cp, dp, ep, edp;
  };
  for (const Mesh m : {Mesh{1, 4, 4, 1}, Mesh{2, 2, 2, 2}, Mesh{1, 4, 1, 4}, Mesh{4, 2, 2, 4}}) {
    INFO("cp " << m.cp << " dp " << m.dp << " ep " << m.ep << " edp " << m.edp);
    const ModelLayout layout = tiny_layout(m.ep);
    const ParallelSpec spec =
        make_parallel_spec(layout, dims(m.cp, m.dp, m.ep, m.edp), /*zero=*/true);
    const int world = spec.world();
    REQUIRE(world == m.ep * m.edp);
    CHECK(spec.zero1());
    std::vector<int64_t> load(size_t(world), 0);
    int64_t largest = 0;
    for (int p = 0; p < int(layout.params.size()); ++p) {
      const bool expert = layout.params[p].kind == ParamKind::Experts;
      CHECK((spec.params[size_t(p)].replicas == kExpertReplicas) == expert);
      CHECK((spec.params[size_t(p)].replicas == kDenseReplicas) == !expert);
      int owners = 0;
      for (int r = 0; r < world; ++r)
        if (spec.owns(r, p)) ++owners, load[size_t(r)] += layout.params[p].numel();
      // Dense: one owner in the world; experts: one in each edp group, i.e. one per ep rank.
      CHECK(owners == (expert ? m.ep : 1));
      largest = std::max(largest, layout.params[p].numel());
    }
    const auto [lo, hi] = std::minmax_element(load.begin(), load.end());
    CHECK(*hi - *lo <= 2 * largest);  // greedy per group: within the largest parameter of each
  }
}

TEST_CASE("parallel spec: without ZeRO, or on one rank, every rank owns every parameter", "[cpu][plan]") {
  const ModelLayout layout = tiny_layout(2);
  const ParallelSpec off = make_parallel_spec(layout, dims(2, 2, 2, 2), /*zero=*/false);
  CHECK(!off.zero1());
  const ModelLayout whole = tiny_layout(1);
  const ParallelSpec one = make_parallel_spec(whole, dims(1, 1, 1, 1), /*zero=*/true);
  CHECK(!one.zero1());
  for (int p = 0; p < int(layout.params.size()); ++p)
    for (int r = 0; r < 4; ++r) CHECK(off.owns(r, p));
  for (int p = 0; p < int(whole.params.size()); ++p) CHECK(one.owns(0, p));
}

TEST_CASE("parallel spec: a gradient's norm is summed over the axes its pieces differ along",
          "[cpu][plan]") {
  const ModelLayout layout = tiny_layout(2);
  const ParallelSpec whole = make_parallel_spec(layout, dims(2, 2, 2, 2), /*zero=*/true);
  const ParallelSpec sliced =
      make_parallel_spec(layout, dims(2, 2, 2, 2), /*zero=*/false, /*slice=*/true);
  const ParallelSpec one_replica = make_parallel_spec(layout, dims(1, 2, 2, 1), false, true);
  for (int p = 0; p < int(layout.params.size()); ++p) {
    const bool expert = layout.params[p].kind == ParamKind::Experts;
    INFO(layout.params[p].name);
    // Whole (replicated or ZeRO-1 owners): every rank of a stage holds the summed gradient, but
    // each expert rank its own experts.
    CHECK(whole.norm_axes(p) == (expert ? Axes{Axis::Pp, Axis::Ep} : Axes{Axis::Pp}));
    // Sliced: each replica a slice too.
    CHECK(sliced.norm_axes(p) ==
          (expert ? Axes{Axis::Pp, Axis::Ep, Axis::Edp} : Axes{Axis::Pp, Axis::Dp, Axis::Cp}));
    // One replica of each expert (edp 1): its slice is the whole tensor.
    if (expert) CHECK(one_replica.norm_axes(p) == Axes{Axis::Pp, Axis::Ep});
  }
}
