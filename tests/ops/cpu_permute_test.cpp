// CPU reference MoE token permutation: the route plan against an independent stable sort (counts
// exact, inverse permutations, an expert with no tokens, top_k = 1 and = E), permute ∘ unpermute
// with unit weights = K·x, and finite-difference checks of permute_bwd and unpermute_bwd.
#include <algorithm>
#include <numeric>
#include <vector>

#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

// Route plans are integer bookkeeping: compared exactly.
constexpr int64_t kExactMismatches = 0;

struct Plan {
  HostTensor counts, offsets, perm_src, slot_of;
  [[gnu::noinline]] Plan(int64_t tokens, int64_t experts, int64_t top_k)
      : counts(DType::I32, {experts}),
        offsets(DType::I32, {experts + 1}),
        perm_src(DType::I32, {tokens * top_k}),
        slot_of(DType::I32, {tokens * top_k}) {}
};

// topk_idx [T,K] with distinct experts per token drawn from [0, E) minus `skip` (-1: none).
HostTensor make_topk_idx(int64_t tokens, int64_t experts, int64_t top_k, uint64_t seed,
                         int32_t skip) {
  HostTensor idx(DType::I32, {tokens, top_k});
  for (int64_t t = 0; t < tokens; ++t) {
    std::vector<int32_t> pool;
    for (int32_t e = 0; e < experts; ++e)
      if (e != skip) pool.push_back(e);
    for (size_t i = pool.size(); i > 1; --i)
      std::swap(pool[i - 1], pool[philox_u64(seed, uint64_t(t), i) % i]);
    for (int64_t k = 0; k < top_k; ++k) idx.ptr<int32_t>()[t * top_k + k] = pool[size_t(k)];
  }
  return idx;
}

}  // namespace

TEST_CASE("moe_route_plan equals a stable sort of assignments by expert", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  struct Case {
    int64_t tokens, experts, top_k;
    int32_t skip;
  };
  const Case cases[] = {{7, 5, 2, 3}, {13, 4, 1, 0}, {5, 3, 3, -1}, {1, 1, 1, -1}, {11, 8, 3, 7}};
  for (const Case& c : cases) {
    INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " skipped " << c.skip);
    HostTensor idx = make_topk_idx(c.tokens, c.experts, c.top_k, 1, c.skip);
    Plan p(c.tokens, c.experts, c.top_k);
    for (HostTensor* t : {&p.counts, &p.offsets, &p.perm_src, &p.slot_of}) ops.fill(*t, -7);
    ops.moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, idx);
    const int64_t n = c.tokens * c.top_k;
    const int32_t* ix = idx.ptr<int32_t>();
    std::vector<int32_t> order(static_cast<size_t>(n));  // assignment at each expert-ordered row
    std::iota(order.begin(), order.end(), 0);
    std::stable_sort(order.begin(), order.end(),
                     [&](int32_t a, int32_t b) { return ix[a] < ix[b]; });
    int64_t bad = 0, total = 0;
    for (int64_t e = 0; e < c.experts; ++e) {
      const int64_t want = std::count(ix, ix + n, int32_t(e));
      bad += p.counts.ptr<int32_t>()[e] != want;
      bad += p.offsets.ptr<int32_t>()[e] != total;
      total += want;
    }
    bad += p.offsets.ptr<int32_t>()[c.experts] != n;
    if (c.skip >= 0) CHECK(p.counts.ptr<int32_t>()[c.skip] == 0);
    CHECK(total == n);
    for (int64_t r = 0; r < n; ++r) {
      bad += p.perm_src.ptr<int32_t>()[r] != order[size_t(r)] / c.top_k;
      bad += p.slot_of.ptr<int32_t>()[order[size_t(r)]] != r;
    }
    // perm_src and slot_of describe the same map: the row of assignment a holds token a / K.
    for (int64_t a = 0; a < n; ++a)
      bad += p.perm_src.ptr<int32_t>()[p.slot_of.ptr<int32_t>()[a]] != a / c.top_k;
    CHECK(bad == kExactMismatches);
  }
}

TEST_CASE("permute then unpermute with unit weights returns K·x", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 9, experts = 4, top_k = 3, hidden = 13;
  for (DType dt : {DType::F32, DType::F64}) {
    HostTensor idx = make_topk_idx(tokens, experts, top_k, 2, -1);
    Plan p(tokens, experts, top_k);
    ops.moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, idx);
    HostTensor x = bf16_exact_tensor(dt, {tokens, hidden}, 3);
    HostTensor xp(dt, {tokens * top_k, hidden}), y(dt, {tokens, hidden}), ones(dt, {tokens, top_k});
    ops.fill(ones, 1.0);
    ops.moe_permute_fwd(xp, x, p.perm_src);
    for (int64_t r = 0; r < tokens * top_k; ++r)
      for (int64_t c = 0; c < hidden; ++c)
        CHECK(xp.get(r * hidden + c) == x.get(p.perm_src.ptr<int32_t>()[r] * hidden + c));
    ops.fill(y, std::nan(""));
    ops.moe_unpermute_fwd(y, xp, p.slot_of, ones, false);
    // K copies of a bf16 value add exactly (K = 3 needs two more bits than bf16's mantissa).
    for (int64_t i = 0; i < tokens * hidden; ++i) CHECK(y.get(i) == double(top_k) * x.get(i));
    CHECK(max_abs(x) > 0);
  }
}

TEST_CASE("permute and unpermute backwards match finite differences (fp64)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 7, experts = 5, hidden = 3;
  for (int64_t top_k : {1, 2, 5})
    for (bool accumulate : {false, true}) {
      INFO("top_k " << top_k << " accumulate " << accumulate);
      const DType dt = DType::F64;
      HostTensor idx = make_topk_idx(tokens, experts, top_k, 4, top_k < experts ? 2 : -1);
      Plan p(tokens, experts, top_k);
      ops.moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, idx);
      const int64_t rows = tokens * top_k;

      // permute: L = Σ W ⊙ xp(x).
      HostTensor x = random_tensor(dt, {tokens, hidden}, 5);
      HostTensor wp = random_tensor(dt, {rows, hidden}, 6), xp(dt, {rows, hidden});
      auto permute_loss = [&] {
        ops.moe_permute_fwd(xp, x, p.perm_src);
        return weighted_sum(wp, xp);
      };
      HostTensor dx0 = random_tensor(dt, {tokens, hidden}, 7), dx = dx0;
      ops.moe_permute_bwd(dx, wp, p.slot_of, int(top_k), accumulate);
      if (accumulate)
        for (int64_t i = 0; i < dx.numel(); ++i) dx.set(i, dx.get(i) - dx0.get(i));
      check_grad("permute x", x, dx, permute_loss);

      // unpermute: L = Σ W ⊙ y(yp, topk_w), y accumulated onto y0 when asked.
      HostTensor yp = random_tensor(dt, {rows, hidden}, 8);
      HostTensor topk_w = random_tensor(dt, {tokens, top_k}, 9, 0, 1);
      HostTensor wy = random_tensor(dt, {tokens, hidden}, 10);
      HostTensor y0 = random_tensor(dt, {tokens, hidden}, 11), y(dt, {tokens, hidden});
      auto unpermute_loss = [&] {
        y = y0;
        ops.moe_unpermute_fwd(y, yp, p.slot_of, topk_w, accumulate);
        return weighted_sum(wy, y);
      };
      HostTensor dyp(dt, {rows, hidden}), dtopk_w(dt, {tokens, top_k});
      ops.fill(dyp, std::nan(""));
      ops.fill(dtopk_w, std::nan(""));
      ops.moe_unpermute_bwd(dyp, dtopk_w, wy, yp, p.slot_of, topk_w);
      check_grad("unpermute yp", yp, dyp, unpermute_loss);
      check_grad("unpermute topk_w", topk_w, dtopk_w, unpermute_loss);
    }
}

TEST_CASE("permutation ops reject out-of-range indices and non-permutations", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t tokens = 3, top_k = 2, hidden = 4;
  HostTensor idx(DType::I32, {tokens, top_k});
  for (int i = 0; i < 6; ++i) idx.ptr<int32_t>()[i] = i % 3;
  Plan p(tokens, 3, top_k);
  CHECK_NOTHROW(ops.moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, idx));
  Plan small(tokens, 2, top_k);  // expert 2 does not exist
  CHECK_THROWS_AS(
      ops.moe_route_plan(small.counts, small.offsets, small.perm_src, small.slot_of, idx), Error);
  HostTensor x(DType::F32, {tokens, hidden}), xp(DType::F32, {tokens * top_k, hidden});
  HostTensor w(DType::F32, {tokens, top_k}), dw(DType::F32, {tokens, top_k});
  CHECK_NOTHROW(ops.moe_permute_fwd(xp, x, p.perm_src));
  p.perm_src.ptr<int32_t>()[0] = tokens;
  CHECK_THROWS_AS(ops.moe_permute_fwd(xp, x, p.perm_src), Error);
  CHECK_NOTHROW(ops.moe_unpermute_bwd(xp, dw, x, xp, p.slot_of, w));
  p.slot_of.ptr<int32_t>()[1] = p.slot_of.ptr<int32_t>()[0];
  CHECK_THROWS_AS(ops.moe_unpermute_bwd(xp, dw, x, xp, p.slot_of, w), Error);
  HostTensor x64(DType::F64, {tokens, hidden});
  CHECK_THROWS_AS(ops.moe_permute_bwd(x64, xp, p.slot_of, int(top_k), false), Error);
}
