// moe_permute: the CPU reference route plan against an independent stable sort, permute ∘
// unpermute with unit weights = K·x, finite differences of both backwards, bad indices; the CUDA
// backend ([gpu]) exact against the reference (device and host counts/offsets, T = 1, an expert
// that receives nothing, K = 1, K = E, E = 1000) and run-to-run bitwise determinism.

#include <algorithm>
#include <numeric>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
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

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include <cmath>

#include "catch.h"
#include "gpu/moe_test_util.h"

namespace cuda {
using namespace mop;
using namespace mop::test;

namespace {

constexpr double kF32Eps = 1.0 / (1 << 24);  // unit roundoff of fp32
constexpr int64_t kExact = 0;

// The row kernels repeat the reference's fp32 operations in its order (sums over k in k order,
// w·v rounded before it is added, no FMA) and round the result to bf16 once: they equal the
// reference rounded to bf16, bit for bit.
HostTensor rounded(const HostTensor& ref) {
  return bf16_rounded_f32(ref);
}

struct PlanCase {
  int64_t tokens, experts, top_k;
  int32_t skip;  // an expert that receives no tokens (-1: none)
};

struct RowCase {
  int64_t tokens, experts, top_k, hidden;
};
const RowCase kRowCases[] = {{1, 5, 2, 72}, {13, 5, 2, 13},      {13, 5, 2, 72},   {13, 4, 1, 264},
                             {7, 3, 3, 72}, {1000, 128, 8, 264}, {300, 64, 40, 16}};

// A plan for the row tests: the GPU's, checked against the CPU's, plus the CPU's for the reference.
// (Device inputs stay alive in the struct: ops run asynchronously.)
struct Routing {
  HostTensor idx;
  DeviceTensor d_idx;
  HostPlan host;
  DevicePlan dev;
};
Routing make_routing(Ops& ops, const RowCase& c, uint64_t seed) {
  HostTensor idx = make_topk_idx(c.tokens, c.experts, c.top_k, seed, c.top_k < c.experts ? 1 : -1);
  DeviceTensor d_idx = upload(idx);
  HostPlan host = cpu_route_plan(idx, c.experts);
  DevicePlan dev = gpu_route_plan(ops, d_idx, c.experts);
  CHECK(count_mismatches(download(dev.slot_of), host.slot_of, 0, 0) == kExact);
  return {std::move(idx), std::move(d_idx), std::move(host), std::move(dev)};
}

HostTensor random_bf16(std::initializer_list<int64_t> dims, uint64_t seed) {
  HostTensor x(DType::F32, dims);
  fill_uniform(x, seed);  // bf16-exact values in [-1, 1)
  return x;
}

}  // namespace

TEST_CASE("moe_route_plan equals the CPU reference exactly", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  const PlanCase cases[] = {{1, 5, 2, -1},      {13, 5, 2, 3},      {13, 4, 1, 0},
                            {5, 3, 3, -1},      {1000, 128, 8, 17}, {3000, 128, 8, -1},
                            {16384, 128, 8, 5}, {5000, 2, 1, -1},   {777, 1000, 2, 999},
                            {2049, 7, 7, -1}};
  for (const PlanCase& c : cases)
    for (bool host_counts : {false, true}) {
      INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " empty " << c.skip
                << " host counts/offsets " << host_counts);
      HostTensor idx = make_topk_idx(c.tokens, c.experts, c.top_k, 21, c.skip);
      HostPlan ref = cpu_route_plan(idx, c.experts);
      DeviceTensor d_idx = upload(idx);
      HostTensor counts, offsets, perm_src, slot_of;
      if (host_counts) {
        HostPlan h(c.tokens, c.experts, c.top_k);
        DevicePlan d(c.tokens, c.experts, c.top_k);
        for (HostTensor* t : {&h.counts, &h.offsets}) make_cpu_ops()->fill(*t, -7);
        poison(d.perm_src);
        poison(d.slot_of);
        settle();
        ops->moe_route_plan(h.counts, h.offsets, d.perm_src, d.slot_of, d_idx);
        counts = h.counts;  // written before the op returned
        offsets = h.offsets;
        perm_src = download(d.perm_src);
        slot_of = download(d.slot_of);
      } else {
        DevicePlan d = gpu_route_plan(*ops, d_idx, c.experts);
        counts = download(d.counts);
        offsets = download(d.offsets);
        perm_src = download(d.perm_src);
        slot_of = download(d.slot_of);
      }
      CHECK(count_mismatches(counts, ref.counts, 0, 0) == kExact);
      CHECK(count_mismatches(offsets, ref.offsets, 0, 0) == kExact);
      CHECK(count_mismatches(perm_src, ref.perm_src, 0, 0) == kExact);
      CHECK(count_mismatches(slot_of, ref.slot_of, 0, 0) == kExact);
      if (c.skip >= 0) CHECK(counts.ptr<int32_t>()[c.skip] == 0);
      CHECK(offsets.ptr<int32_t>()[c.experts] == c.tokens * c.top_k);
    }
}

TEST_CASE("moe_route_plan with every token on the same experts", "[gpu][moe]") {
  // Whole warps of equal keys: ranks come from __match_any_sync groups of 32.
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  const int64_t tokens = 2500, experts = 16, top_k = 4;
  HostTensor idx(DType::I32, {tokens, top_k});
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t k = 0; k < top_k; ++k) idx.ptr<int32_t>()[t * top_k + k] = int32_t(k * 5);
  HostPlan ref = cpu_route_plan(idx, experts);
  DeviceTensor d_idx = upload(idx);
  DevicePlan d = gpu_route_plan(*ops, d_idx, experts);
  CHECK(count_mismatches(download(d.counts), ref.counts, 0, 0) == kExact);
  CHECK(count_mismatches(download(d.offsets), ref.offsets, 0, 0) == kExact);
  CHECK(count_mismatches(download(d.perm_src), ref.perm_src, 0, 0) == kExact);
  CHECK(count_mismatches(download(d.slot_of), ref.slot_of, 0, 0) == kExact);
}

TEST_CASE("moe_permute_fwd and moe_permute_bwd match the CPU reference", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  auto cpu = make_cpu_ops();
  for (const RowCase& c : kRowCases) {
    INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " H " << c.hidden);
    const int64_t T = c.tokens, R = c.tokens * c.top_k, H = c.hidden;
    Routing r = make_routing(*ops, c, 31);

    HostTensor x = random_bf16({T, H}, 32), xp_ref(DType::F32, {R, H});
    cpu->moe_permute_fwd(xp_ref, x, r.host.perm_src);
    DeviceTensor d_x = upload(x, DType::BF16), d_xp(DType::BF16, {R, H});
    poison(d_xp);
    settle();
    ops->moe_permute_fwd(d_xp, d_x, r.dev.perm_src);
    CHECK(count_mismatches(download(d_xp), xp_ref, 0, 0) == kExact);

    HostTensor dxp = random_bf16({R, H}, 33);
    DeviceTensor d_dxp = upload(dxp, DType::BF16);
    for (bool accumulate : {false, true}) {
      INFO("accumulate " << accumulate);
      HostTensor dx_ref = random_bf16({T, H}, 34);
      DeviceTensor d_dx = upload(dx_ref, DType::BF16);
      if (!accumulate) poison(d_dx);
      settle();
      cpu->moe_permute_bwd(dx_ref, dxp, r.host.slot_of, int(c.top_k), accumulate);
      ops->moe_permute_bwd(d_dx, d_dxp, r.dev.slot_of, int(c.top_k), accumulate);
      HostTensor got = download(d_dx);
      CHECK(count_mismatches(got, rounded(dx_ref), 0, 0) == kExact);
      if (!accumulate) {  // determinism
        ops->moe_permute_bwd(d_dx, d_dxp, r.dev.slot_of, int(c.top_k), false);
        CHECK(bitwise_equal(download(d_dx), got));
      }
    }
  }
}

TEST_CASE("moe_unpermute_fwd and moe_unpermute_bwd match the CPU reference", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  auto cpu = make_cpu_ops();
  for (const RowCase& c : kRowCases) {
    INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " H " << c.hidden);
    const int64_t T = c.tokens, K = c.top_k, R = c.tokens * c.top_k, H = c.hidden;
    Routing r = make_routing(*ops, c, 41);
    HostTensor yp = random_bf16({R, H}, 42), topk_w(DType::F32, {T, K});
    fill_uniform(topk_w, 43, 0, 1);
    DeviceTensor d_yp = upload(yp, DType::BF16), d_w = upload(topk_w);

    for (bool accumulate : {false, true}) {
      INFO("accumulate " << accumulate);
      HostTensor y_ref = random_bf16({T, H}, 44);
      DeviceTensor d_y = upload(y_ref, DType::BF16);
      if (!accumulate) poison(d_y);
      settle();
      cpu->moe_unpermute_fwd(y_ref, yp, r.host.slot_of, topk_w, accumulate);
      ops->moe_unpermute_fwd(d_y, d_yp, r.dev.slot_of, d_w, accumulate);
      CHECK(count_mismatches(download(d_y), rounded(y_ref), 0, 0) == kExact);
    }

    HostTensor dy = random_bf16({T, H}, 45);
    HostTensor dyp_ref(DType::F32, {R, H}), dw_ref(DType::F32, {T, K});
    cpu->moe_unpermute_bwd(dyp_ref, dw_ref, dy, yp, r.host.slot_of, topk_w);
    DeviceTensor d_dy = upload(dy, DType::BF16), d_dyp(DType::BF16, {R, H}),
                 d_dw(DType::F32, {T, K});
    poison(d_dyp);
    poison(d_dw);
    settle();
    ops->moe_unpermute_bwd(d_dyp, d_dw, d_dy, d_yp, r.dev.slot_of, d_w);
    HostTensor dyp = download(d_dyp), dw = download(d_dw);
    // dyp is one fp32 product rounded to bf16.
    CHECK(count_mismatches(dyp, rounded(dyp_ref), 0, 0) == kExact);
    // dtopk_w: the same H products summed in two orders (lane partials and a butterfly against
    // a sequential loop), each within H·u·Σ|dy·yp| of the exact dot.
    int64_t bad = 0;
    for (int64_t t = 0; t < T; ++t)
      for (int64_t k = 0; k < K; ++k) {
        const int64_t row = r.host.slot_of.ptr<int32_t>()[t * K + k];
        double abs_dot = 0;
        for (int64_t h = 0; h < H; ++h)
          abs_dot += std::fabs(dy.get(t * H + h) * yp.get(row * H + h));
        const double tol = 2 * double(H + 1) * kF32Eps * abs_dot;
        if (!(std::fabs(dw.get(t * K + k) - dw_ref.get(t * K + k)) <= tol)) ++bad;
      }
    CHECK(bad == 0);
    ops->moe_unpermute_bwd(d_dyp, d_dw, d_dy, d_yp, r.dev.slot_of, d_w);
    CHECK(bitwise_equal(download(d_dw), dw));
    CHECK(bitwise_equal(download(d_dyp), dyp));
  }
}

TEST_CASE("permute then unpermute with unit weights returns K·x on the GPU", "[gpu][moe]") {
  if (skip_without_gpu()) return;
  auto ops = make_cuda_ops(0);
  for (const RowCase& c :
       {RowCase{13, 5, 3, 72}, RowCase{1000, 128, 8, 264}, RowCase{9, 4, 3, 13}}) {
    INFO("T " << c.tokens << " E " << c.experts << " K " << c.top_k << " H " << c.hidden);
    const int64_t T = c.tokens, K = c.top_k, R = T * K, H = c.hidden;
    HostTensor idx = make_topk_idx(T, c.experts, K, 51, 0);
    DeviceTensor d_idx = upload(idx);
    DevicePlan plan = gpu_route_plan(*ops, d_idx, c.experts);
    HostTensor x = random_bf16({T, H}, 52), ones(DType::F32, {T, K});
    make_cpu_ops()->fill(ones, 1.0);
    DeviceTensor d_x = upload(x, DType::BF16), d_ones = upload(ones);
    DeviceTensor d_xp(DType::BF16, {R, H}), d_y(DType::BF16, {T, H});
    poison(d_xp);
    poison(d_y);
    settle();
    ops->moe_permute_fwd(d_xp, d_x, plan.perm_src);
    ops->moe_unpermute_fwd(d_y, d_xp, plan.slot_of, d_ones, false);
    // K copies of a bf16 value add exactly in fp32; K·x is then rounded to bf16 once.
    HostTensor want(DType::F32, {T, H});
    for (int64_t i = 0; i < T * H; ++i) want.set(i, round_bf16(float(double(K) * x.get(i))));
    CHECK(count_mismatches(download(d_y), want, 0, 0) == kExact);
  }
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
