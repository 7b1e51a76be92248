// CPU reference timings of the heavy ops at tiny-config shapes (mop_bench's CPU cases, in every
// build). Correctness is the [ops] tests' job; here outputs are only checked to be finite and
// nonzero before the timing is trusted.
#include <omp.h>

#include <cmath>
#include <cstdio>

#include "bench.h"
#include "core/error.h"
#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;
using mop::bench::best_seconds;

namespace {

bool finite_nonzero(const HostTensor& x) {
  for (int64_t i = 0; i < x.numel(); ++i)
    if (!std::isfinite(x.get(i))) return false;
  return max_abs(x) > 0;
}

}  // namespace

MOP_BENCH_CPU("gemm cpu 2048x1024x256 fp32, all transposes") {
  Ops& ops = test::cpu_ops();
  const int64_t m = 2048, n = 1024, k = 256;
  for (bool ta : {false, true})
    for (bool tb : {false, true}) {
      HostTensor a =
          ta ? random_tensor(DType::F32, {k, m}, 1) : random_tensor(DType::F32, {m, k}, 1);
      HostTensor b =
          tb ? random_tensor(DType::F32, {n, k}, 2) : random_tensor(DType::F32, {k, n}, 2);
      HostTensor c(DType::F32, {m, n});
      const double s = best_seconds([&] { ops.gemm(c, a, ta, b, tb, 1, 0); });
      MOP_CHECK(finite_nonzero(c), "c is not finite and nonzero");
      // FLOPs = 2·M·N·K.
      std::printf("gemm fp32 M=%ld N=%ld K=%ld ta=%d tb=%d threads=%d: %.2f ms, %.1f GFLOP/s\n",
                  long(m), long(n), long(k), ta, tb, omp_get_max_threads(), s * 1e3,
                  2.0 * m * n * k / s * 1e-9);
    }
}

MOP_BENCH_CPU("attention cpu B=8 S=256 Nq=4 Nkv=2 D=32 fp32") {
  Ops& ops = test::cpu_ops();
  const int batch = 8;
  const int64_t seq = 256, nq = 4, nkv = 2, d = 32, tokens = batch * seq;
  HostTensor q = random_tensor(DType::F32, {tokens, nq, d}, 1);
  HostTensor k = random_tensor(DType::F32, {tokens, nkv, d}, 2);
  HostTensor v = random_tensor(DType::F32, {tokens, nkv, d}, 3);
  HostTensor dout = random_tensor(DType::F32, {tokens, nq, d}, 4);
  HostTensor out(DType::F32, {tokens, nq, d}), lse(DType::F32, {batch, nq, seq});
  HostTensor dq = q, dk = k, dv = v;
  const float scale = 1.0f / std::sqrt(float(d));
  const double fwd = best_seconds([&] { ops.attention_fwd(out, lse, q, k, v, batch, scale, true); });
  const double bwd =
      best_seconds([&] { ops.attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, batch, scale, true); });
  MOP_CHECK(finite_nonzero(out), "out is not finite and nonzero");
  MOP_CHECK(finite_nonzero(dk), "dk is not finite and nonzero");
  // Causal pairs P = S(S+1)/2 per (sequence, head); forward is 2 matmuls (QKᵀ, PV) = 4·D·P FLOPs,
  // backward 5 (QKᵀ again, dO·Vᵀ, dV, dQ, dK) = 10·D·P.
  const double pairs = double(batch) * nq * seq * (seq + 1) / 2;
  std::printf(
      "attention fp32 B=%d S=%ld Nq=%ld Nkv=%ld D=%ld threads=%d: fwd %.2f ms (%.1f GFLOP/s), "
      "bwd %.2f ms (%.1f GFLOP/s)\n",
      batch, long(seq), long(nq), long(nkv), long(d), omp_get_max_threads(), fwd * 1e3,
      4 * d * pairs / fwd * 1e-9, bwd * 1e3, 10 * d * pairs / bwd * 1e-9);
}

MOP_BENCH_CPU("lmhead cpu T=2048 H=256 V=8192 fp32, chunk 512") {
  Ops& ops = test::cpu_ops();
  const int64_t tokens = 2048, hidden = 256, vocab = 8192, chunk = 512;
  HostTensor x = random_tensor(DType::F32, {tokens, hidden}, 1);
  HostTensor w = random_tensor(DType::F32, {vocab, hidden}, 2, -0.1, 0.1);
  HostTensor targets(DType::I32, {tokens});
  for (int64_t t = 0; t < tokens; ++t) targets.ptr<int32_t>()[t] = int32_t(t * 7 % vocab);
  HostTensor loss(DType::F32, {tokens}), lse(DType::F32, {tokens}), ws(DType::F32, {chunk, vocab});
  HostTensor dx(DType::F32, {tokens, hidden}), dw(DType::F32, {vocab, hidden});
  const double fwd = best_seconds([&] { ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws); });
  const double bwd =
      best_seconds([&] { ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, 1.0f / tokens, ws); });
  MOP_CHECK(finite_nonzero(loss), "loss is not finite and nonzero");
  MOP_CHECK(finite_nonzero(dx), "dx is not finite and nonzero");
  // Forward one GEMM (2·T·V·H), backward three (logits again, dx, dw).
  const double gemm_flops = 2.0 * tokens * vocab * hidden;
  std::printf(
      "lmhead_ce fp32 T=%ld H=%ld V=%ld C=%ld: fwd %.1f ms (%.1f GFLOP/s), bwd %.1f ms "
      "(%.1f GFLOP/s)\n",
      long(tokens), long(hidden), long(vocab), long(chunk), fwd * 1e3, gemm_flops / fwd * 1e-9,
      bwd * 1e3, 3 * gemm_flops / bwd * 1e-9);
}
