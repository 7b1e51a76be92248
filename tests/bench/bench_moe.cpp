// MoE routing benchmarks (mop_bench moe): router forward/backward, the route plan and the token
// permutation forward/backward at the q3moe-8l shapes — E = 128 experts, top-8, H = 2048 — for
// T = 4096 and 16384 tokens. Router and route plan are validated against the CPU reference at the
// timed shape, the permutations at T = 512 (same H, E, K). GB/s counts the bytes an op must move
// at least once (fp32/int32 4 bytes, bf16 2; R = T·K expert-ordered rows):
//   router_fwd     T·E·4 logits + T·E·4 probs + T·4 lse + T·K·8 topk_idx/topk_w
//   router_bwd     T·E·4 probs + T·E·4 dlogits + T·4 lse + T·K·12 dtopk_w/topk_idx/topk_w
//   route_plan     T·K·4 topk_idx + 2·R·4 perm_src/slot_of
//   permute_fwd    T·H·2 x + R·H·2 xp + R·4 perm_src
//   permute_bwd    R·H·2 dxp + T·H·2 dx + R·4 slot_of           (accumulate off, as in the model)
//   unpermute_fwd  R·H·2 yp + 2·T·H·2 y + R·8 slot_of/topk_w    (accumulate on, as in the model)
//   unpermute_bwd  T·H·2 dy + 2·R·H·2 yp/dyp + R·12 slot_of/topk_w/dtopk_w
#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <cmath>
#include <string>

#include "bench.h"
#include "runtime/cuda_check.h"
#include "gpu/moe_test_util.h"
#include "ops/cuda_ops.h"

namespace mop::bench {
namespace {

using test::DeviceTensor;
using test::HostTensor;

constexpr int64_t kExperts = 128, kTopK = 8, kHidden = 2048;  // q3moe-8l
constexpr int64_t kValidateTokens = 512;
constexpr float kZGradScale = 1e-4f;

// Tolerances as in tests/gpu/moe_router_test.cpp (reasons there): probabilities differ by the
// reordered sum over E and expf's ulps; dlogits by the reordered Σ p·dp, ≤ (E+8)·2u·max|dp|·p,
// below 2e-5 for these inputs (max|dp| ≲ 20, p ≤ 1).
constexpr double kProbRtol = 2e-5, kLseAtol = 2e-5, kDlogitsAtol = 2e-5, kDlogitsRtol = 1e-5;
constexpr double kF32Eps = 1.0 / (1 << 24);

std::string shape_str(int64_t tokens, bool with_hidden) {
  std::string s = "T=" + std::to_string(tokens) + " E=" + std::to_string(kExperts) +
                  " K=" + std::to_string(kTopK);
  return with_hidden ? s + " H=" + std::to_string(kHidden) : s;
}

HostTensor random_f32(std::initializer_list<int64_t> dims, uint64_t seed, double lo = -1,
                      double hi = 1) {
  HostTensor t(DType::F32, dims);
  test::fill_uniform(t, seed, lo, hi);
  return t;
}

// A device buffer of finite bf16 values (0x3F3F ≈ 0.75) for timing: the kernels are
// bandwidth-bound, so the values do not matter.
DeviceTensor pattern_bf16(std::initializer_list<int64_t> dims) {
  DeviceTensor d(DType::BF16, dims);
  MOP_CUDA_CHECK(cudaMemset(d.t.data, 0x3F, d.t.bytes()));
  return d;
}

void router_case(int64_t tokens) {
  const int64_t T = tokens, E = kExperts, K = kTopK;
  CudaOps ops;
  auto cpu = make_cpu_ops();
  HostTensor logits = random_f32({T, E}, 1, -3, 3);
  HostTensor idx(DType::I32, {T, K}), w(DType::F32, {T, K}), probs(DType::F32, {T, E}),
      lse(DType::F32, {T});
  cpu->router_fwd(idx, w, probs, lse, logits, true);
  HostTensor dw = random_f32({T, K}, 2), aux = random_f32({E}, 3, -0.1, 0.1);
  HostTensor dlogits(DType::F32, {T, E});
  cpu->router_bwd(dlogits, dw, probs, lse, idx, w, aux, kZGradScale, true);

  DeviceTensor g_logits = test::upload(logits), g_idx(DType::I32, {T, K}), g_w(DType::F32, {T, K});
  DeviceTensor g_probs(DType::F32, {T, E}), g_lse(DType::F32, {T}), g_dlogits(DType::F32, {T, E});
  for (const DeviceTensor* x : {&g_idx, &g_w, &g_probs, &g_lse, &g_dlogits}) test::poison(*x);
  test::settle();
  ops.router_fwd(g_idx, g_w, g_probs, g_lse, g_logits, true);
  const bool fwd_valid =
      test::count_mismatches(test::download(g_idx), idx, 0, 0) == 0 &&
      test::count_mismatches(test::download(g_probs), probs, 0, kProbRtol) == 0 &&
      test::count_mismatches(test::download(g_w), w, 0, kProbRtol) == 0 &&
      test::count_mismatches(test::download(g_lse), lse, kLseAtol, 0) == 0;
  // The backward is validated on the reference's forward outputs (as in the test).
  DeviceTensor r_probs = test::upload(probs), r_lse = test::upload(lse), r_idx = test::upload(idx);
  DeviceTensor r_w = test::upload(w), g_dw = test::upload(dw), g_aux = test::upload(aux);
  test::settle();
  ops.router_bwd(g_dlogits, g_dw, r_probs, r_lse, r_idx, r_w, g_aux, kZGradScale, true);
  const bool bwd_valid =
      test::count_mismatches(test::download(g_dlogits), dlogits, kDlogitsAtol, kDlogitsRtol) == 0;

  auto fwd = [&] { ops.router_fwd(g_idx, g_w, g_probs, g_lse, g_logits, true); };
  auto bwd = [&] {
    ops.router_bwd(g_dlogits, g_dw, g_probs, g_lse, g_idx, g_w, g_aux, kZGradScale, true);
  };
  const double fwd_bytes = double(T) * (E * 8 + 4 + K * 8);
  const double bwd_bytes = double(T) * (E * 8 + 4 + K * 12);
  report("router_fwd " + shape_str(T, false), fwd_valid, time_ms(fwd, ops.cuda_stream()), 0, fwd_bytes,
         kHbmGBps);
  report("router_bwd " + shape_str(T, false), bwd_valid, time_ms(bwd, ops.cuda_stream()), 0, bwd_bytes,
         kHbmGBps);
}

void route_plan_case(int64_t tokens) {
  const int64_t T = tokens, E = kExperts, K = kTopK;
  CudaOps ops;
  HostTensor idx = test::make_topk_idx(T, E, K, 4, -1);
  test::HostPlan ref = test::cpu_route_plan(idx, E);
  DeviceTensor g_idx = test::upload(idx);
  test::DevicePlan p = test::gpu_route_plan(ops, g_idx, E);
  const bool valid = test::count_mismatches(test::download(p.counts), ref.counts, 0, 0) == 0 &&
                     test::count_mismatches(test::download(p.offsets), ref.offsets, 0, 0) == 0 &&
                     test::count_mismatches(test::download(p.perm_src), ref.perm_src, 0, 0) == 0 &&
                     test::count_mismatches(test::download(p.slot_of), ref.slot_of, 0, 0) == 0;
  auto run = [&] { ops.moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, g_idx); };
  report("moe_route_plan " + shape_str(T, false), valid, time_ms(run, ops.cuda_stream()), 0,
         double(T * K) * 12, kHbmGBps, "workspace " + format_bytes(double(ops.workspace_bytes())));
}

struct PermuteValid {
  bool fwd = false, bwd = false, unfwd = false, unbwd = false;
};

// All four row ops at T = kValidateTokens against the reference (exact where the tests are).
PermuteValid validate_permute() {
  const int64_t T = kValidateTokens, E = kExperts, K = kTopK, R = T * K, H = kHidden;
  CudaOps ops;
  auto cpu = make_cpu_ops();
  HostTensor idx = test::make_topk_idx(T, E, K, 5, 3);
  test::HostPlan plan = test::cpu_route_plan(idx, E);
  DeviceTensor g_idx = test::upload(idx);
  test::DevicePlan g = test::gpu_route_plan(ops, g_idx, E);
  HostTensor x = random_f32({T, H}, 6), dxp = random_f32({R, H}, 7), yp = random_f32({R, H}, 8);
  HostTensor y0 = random_f32({T, H}, 9), dy = random_f32({T, H}, 10);
  HostTensor topk_w = random_f32({T, K}, 11, 0, 1);
  HostTensor xp_ref(DType::F32, {R, H}), dx_ref(DType::F32, {T, H}), y_ref = y0;
  HostTensor dyp_ref(DType::F32, {R, H}), dw_ref(DType::F32, {T, K});
  cpu->moe_permute_fwd(xp_ref, x, plan.perm_src);
  cpu->moe_permute_bwd(dx_ref, dxp, plan.slot_of, int(K), false);
  cpu->moe_unpermute_fwd(y_ref, yp, plan.slot_of, topk_w, true);
  cpu->moe_unpermute_bwd(dyp_ref, dw_ref, dy, yp, plan.slot_of, topk_w);

  DeviceTensor g_x = test::upload(x, DType::BF16), g_dxp = test::upload(dxp, DType::BF16);
  DeviceTensor g_yp = test::upload(yp, DType::BF16), g_y = test::upload(y0, DType::BF16);
  DeviceTensor g_dy = test::upload(dy, DType::BF16), g_w = test::upload(topk_w);
  DeviceTensor g_xp(DType::BF16, {R, H}), g_dx(DType::BF16, {T, H}), g_dyp(DType::BF16, {R, H});
  DeviceTensor g_dw(DType::F32, {T, K});
  for (const DeviceTensor* t : {&g_xp, &g_dx, &g_dyp, &g_dw}) test::poison(*t);
  test::settle();
  ops.moe_permute_fwd(g_xp, g_x, g.perm_src);
  ops.moe_permute_bwd(g_dx, g_dxp, g.slot_of, int(K), false);
  ops.moe_unpermute_fwd(g_y, g_yp, g.slot_of, g_w, true);
  ops.moe_unpermute_bwd(g_dyp, g_dw, g_dy, g_yp, g.slot_of, g_w);
  PermuteValid v;
  v.fwd = test::count_mismatches(test::download(g_xp), xp_ref, 0, 0) == 0;
  v.bwd = test::count_mismatches(test::download(g_dx), test::bf16_rounded_f32(dx_ref), 0, 0) == 0;
  v.unfwd = test::count_mismatches(test::download(g_y), test::bf16_rounded_f32(y_ref), 0, 0) == 0;
  v.unbwd =
      test::count_mismatches(test::download(g_dyp), test::bf16_rounded_f32(dyp_ref), 0, 0) == 0;
  HostTensor dw = test::download(g_dw);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t k = 0; k < K; ++k) {
      const int64_t row = plan.slot_of.ptr<int32_t>()[t * K + k];
      double abs_dot = 0;
      for (int64_t h = 0; h < H; ++h) abs_dot += std::fabs(dy.get(t * H + h) * yp.get(row * H + h));
      const double tol = 2 * double(H + 1) * kF32Eps * abs_dot;  // two summation orders
      v.unbwd = v.unbwd && std::fabs(dw.get(t * K + k) - dw_ref.get(t * K + k)) <= tol;
    }
  return v;
}

void permute_case(int64_t tokens, const PermuteValid& valid) {
  const int64_t T = tokens, E = kExperts, K = kTopK, R = T * K, H = kHidden;
  CudaOps ops;
  DeviceTensor g_idx = test::upload(test::make_topk_idx(T, E, K, 12, -1));
  test::DevicePlan p = test::gpu_route_plan(ops, g_idx, E);
  DeviceTensor x = pattern_bf16({T, H}), y = pattern_bf16({T, H}), rows_a = pattern_bf16({R, H});
  DeviceTensor rows_b = pattern_bf16({R, H});
  DeviceTensor topk_w = test::upload(random_f32({T, K}, 13, 0, 1)), dtopk_w(DType::F32, {T, K});
  test::settle();
  const std::string shape = shape_str(T, true);
  const double tok = double(T) * H * 2, rows = double(R) * H * 2;
  report("moe_permute_fwd " + shape, valid.fwd,
         time_ms([&] { ops.moe_permute_fwd(rows_a, x, p.perm_src); }, ops.cuda_stream()), 0,
         tok + rows + R * 4.0, kHbmGBps);
  report("moe_permute_bwd " + shape, valid.bwd,
         time_ms([&] { ops.moe_permute_bwd(x, rows_a, p.slot_of, int(K), false); }, ops.cuda_stream()),
         0, rows + tok + R * 4.0, kHbmGBps);
  report("moe_unpermute_fwd " + shape, valid.unfwd,
         time_ms([&] { ops.moe_unpermute_fwd(y, rows_a, p.slot_of, topk_w, true); }, ops.cuda_stream()),
         0, rows + 2 * tok + R * 8.0, kHbmGBps);
  report("moe_unpermute_bwd " + shape, valid.unbwd,
         time_ms([&] { ops.moe_unpermute_bwd(rows_b, dtopk_w, y, rows_a, p.slot_of, topk_w); },
                 ops.cuda_stream()),
         0, tok + 2 * rows + R * 12.0, kHbmGBps);
}

}  // namespace

MOP_BENCH("router") {
  for (int64_t tokens : {4096, 16384}) router_case(tokens);
}

MOP_BENCH("moe_permute route plan") {
  for (int64_t tokens : {4096, 16384}) route_plan_case(tokens);
}

MOP_BENCH("moe_permute") {
  const PermuteValid valid = validate_permute();
  for (int64_t tokens : {4096, 16384}) permute_case(tokens, valid);
}

}  // namespace mop::bench

#endif  // MOP_HAVE_CUDA
