// [gpu][moe] route plan and token permutation against the CPU reference: counts, offsets,
// perm_src and slot_of exact (device and host counts/offsets; T = 1, a prime with an expert that
// receives nothing, K = 1, K = E, many blocks, one expert for everything, E = 1000); permute_fwd
// exact; permute_bwd / unpermute_fwd / unpermute_bwd with accumulate on and off over H = 13
// (element path), 72 and 264 (16-byte path, lanes partly idle); permute ∘ unpermute with unit
// weights = K·x; run-to-run bitwise determinism of the reductions.
#ifdef MOP_HAVE_CUDA

#include <cmath>
#include <vector>

#include "catch.h"
#include "gpu/moe_test_util.h"

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

#endif  // MOP_HAVE_CUDA
