// [gpu][gemm] Fused LM head + cross-entropy against the CPU reference: loss and lse, dx and dw
// (accumulated onto a nonzero dw), masked targets, chunks that do not divide T or exceed it, the
// scalar (V % 4 ≠ 0) and float4 kernel paths, and that the training form (lmhead_ce_fwd_bwd) gives
// the bits of forward then backward.
// x and w hold multiples of 1/16 in [−1/4, 1/4]: every logit is a multiple of 2^-8 below 2^3 in
// magnitude, exact in fp32 on both sides, so differences come only from exp/log and the sums.
#ifdef MOP_HAVE_CUDA

#include <cmath>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "ops/ops_test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

constexpr double kUlp = 1.0 / (1 << 24);  // fp32 unit roundoff (half an ulp at 1)
// lse = m + log Σ_v exp(z_v − m): the CPU sums V positive terms in sequence (relative error
// ≤ (V−1)·u), the GPU in a tree with online rescaling (a few u), each exp is within 2 ulp and the
// final m + log rounds by u·|lse|. Hence |Δlse| ≤ (V + 256)·u for |lse| < 64; loss = lse − z with z
// exact adds one rounding, covered by the same bound.
double lse_atol(int64_t vocab) {
  return double(vocab + 256) * kUlp;
}
// dlogits are rounded to bf16 on the GPU (≤ 2^-9 relative) and kept fp32 by the reference, and p
// depends on lse (|Δ| ≲ 1e-4 relative); 2^-8 of Σ|dlogits|·|operand| bounds the effect on dx and
// dw.
constexpr double kDlogitsRel = 1.0 / 256;
// dx is bf16: one more rounding, ≤ one bf16 ulp (2^-7 relative at the bottom of a binade).
constexpr double kBf16Ulp = 1.0 / 128;

#define MOP_REQUIRE_GPU()              \
  do {                                 \
    if (!gpu_available()) {            \
      WARN("no CUDA device: skipped"); \
      return;                          \
    }                                  \
  } while (0)

struct LmCase {
  int64_t tokens, hidden, vocab, chunk;
};

// Multiples of 1/16 in [−1/4, 1/4].
HostTensor dyadic_tensor(std::initializer_list<int64_t> dims, uint64_t seed) {
  HostTensor t(DType::F32, dims);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set(i, double(int(philox_u64(seed, 9, uint64_t(i)) % 9) - 4) / 16);
  REQUIRE(max_abs(t) > 0);
  return t;
}

// Random targets with padding (−1), Hugging Face's ignore index (−100) and every 7th token masked.
HostTensor make_targets(int64_t tokens, int64_t vocab, uint64_t seed) {
  HostTensor t(DType::I32, {tokens});
  for (int64_t i = 0; i < tokens; ++i)
    t.ptr<int32_t>()[i] =
        i % 7 == 6 ? -1 : int32_t(philox_u64(seed, 1, uint64_t(i)) % uint64_t(vocab));
  if (tokens > 1) t.ptr<int32_t>()[1] = -1;
  if (tokens > 4) t.ptr<int32_t>()[4] = -100;
  return t;
}

// Σ_v |dlogits[t,v]|·|w[v,h]| and Σ_t |dlogits[t,v]|·|x[t,h]|: the scale of each dx and dw
// element's error when dlogits are rounded; dlogits from exact logits and the reference lse.
void dlogits_bounds(HostTensor& bound_dx, HostTensor& bound_dw, const HostTensor& x,
                    const HostTensor& w, const HostTensor& targets, const HostTensor& lse,
                    float grad_scale, const LmCase& c) {
  HostTensor abs_dl(DType::F32, {c.tokens, c.vocab}), abs_x = x, abs_w = w;
  for (int64_t t = 0; t < c.tokens; ++t) {
    const int32_t target = targets.ptr<int32_t>()[t];
    for (int64_t v = 0; v < c.vocab; ++v) {
      double z = 0;
      for (int64_t h = 0; h < c.hidden; ++h) z += x.get(t * c.hidden + h) * w.get(v * c.hidden + h);
      const double p = std::exp(z - lse.get(t));
      // + p/16: at the target |p − 1| may be far below p, whose own error (from lse) still counts.
      abs_dl.set(t * c.vocab + v,
                 target < 0 ? 0.0 : (std::fabs(v == target ? p - 1 : p) + p / 16) * grad_scale);
    }
  }
  for (HostTensor* m : {&abs_x, &abs_w})
    for (int64_t i = 0; i < m->numel(); ++i) m->set(i, std::fabs(m->get(i)));
  cpu_ops().gemm(bound_dx, abs_dl, false, abs_w, false, 1, 0);
  cpu_ops().gemm(bound_dw, abs_dl, true, abs_x, false, 1, 0);
}

// Elements with |got − ref| > rel·bound + out_rel·|ref| + atol.
int64_t count_bound_mismatches(const HostTensor& got, const HostTensor& ref,
                               const HostTensor& bound, double rel, double out_rel) {
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double tol = rel * bound.get(i) + out_rel * std::fabs(ref.get(i)) + 1e-30;
    if (!(std::fabs(got.get(i) - ref.get(i)) <= tol)) ++bad;
  }
  return bad;
}

}  // namespace

TEST_CASE("cuda lmhead_ce forward and backward equal the CPU reference; fwd_bwd equals them bitwise",
          "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  const LmCase cases[] = {
      {7, 16, 37, 3},       // V % 4 ≠ 0 (scalar kernels), chunk does not divide T
      {64, 128, 1000, 64},  // float4 kernels, one chunk
      {64, 128, 1000, 24},  // three chunks, the last one partial
      {5, 8, 257, 16},      // the tiny model's vocabulary, chunk larger than T
  };
  const float grad_scale = 0.7f;
  uint64_t seed = 40;
  for (const LmCase& c : cases) {
    INFO("T " << c.tokens << " H " << c.hidden << " V " << c.vocab << " chunk " << c.chunk);
    HostTensor x = dyadic_tensor({c.tokens, c.hidden}, ++seed);
    HostTensor w = dyadic_tensor({c.vocab, c.hidden}, ++seed);
    HostTensor targets = make_targets(c.tokens, c.vocab, ++seed);
    HostTensor dw0 = dyadic_tensor({c.vocab, c.hidden}, ++seed);

    HostTensor loss_ref(DType::F32, {c.tokens}), lse_ref(DType::F32, {c.tokens});
    HostTensor ws_ref(DType::F32, {c.chunk, c.vocab});
    cpu_ops().lmhead_ce_fwd(loss_ref, lse_ref, x, w, targets, ws_ref);
    HostTensor dx_ref(DType::F32, {c.tokens, c.hidden}), dw_ref = dw0;
    cpu_ops().lmhead_ce_bwd(dx_ref, dw_ref, x, w, targets, lse_ref, grad_scale, ws_ref);

    HostTensor bound_dx(DType::F32, {c.tokens, c.hidden}),
        bound_dw(DType::F32, {c.vocab, c.hidden});
    dlogits_bounds(bound_dx, bound_dw, x, w, targets, lse_ref, grad_scale, c);
    // fp32 sums of V (dx) or T (dw) terms on both sides: 2·n·u of the same Σ|·|.
    const double dx_rel = kDlogitsRel + 2 * double(c.vocab) * kUlp;
    const double dw_rel = kDlogitsRel + 2 * double(c.tokens) * kUlp;

    DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16);
    DeviceTensor d_targets = upload(targets);
    DeviceTensor ws(DType::F32, {c.chunk, c.vocab});
    DeviceTensor loss(DType::F32, {c.tokens}), lse(DType::F32, {c.tokens});
    DeviceTensor dx(DType::BF16, {c.tokens, c.hidden});
    HostTensor first_loss, first_lse, first_dx, first_dw;
    for (int run = 0; run < 2; ++run) {
      INFO("run " << run);
      for (const DeviceTensor* t : {&ws, &loss, &lse, &dx}) poison(*t);
      DeviceTensor dw = upload(dw0, DType::F32);
      // Run 0 forward then backward, run 1 the training form (both at once): the same bits.
      if (run == 0) {
        ops.lmhead_ce_fwd(loss, lse, d_x, d_w, d_targets, ws);
        ops.lmhead_ce_bwd(dx, dw, d_x, d_w, d_targets, lse, grad_scale, ws);
      } else {
        ops.lmhead_ce_fwd_bwd(loss, lse, dx, dw, d_x, d_w, d_targets, grad_scale, ws);
      }
      HostTensor got_loss = download(loss), got_lse = download(lse);
      HostTensor got_dx = download(dx), got_dw = download(dw);
      CHECK(count_mismatches(got_lse, lse_ref, lse_atol(c.vocab), 0) == 0);
      CHECK(count_mismatches(got_loss, loss_ref, lse_atol(c.vocab), 0) == 0);
      for (int64_t t = 0; t < c.tokens; ++t)
        if (targets.ptr<int32_t>()[t] < 0) CHECK(got_loss.get(t) == 0.0);

      CHECK(count_bound_mismatches(got_dx, dx_ref, bound_dx, dx_rel, kBf16Ulp) == 0);
      CHECK(count_bound_mismatches(got_dw, dw_ref, bound_dw, dw_rel, 0) == 0);
      CHECK(max_abs(got_dx) > 0);

      if (run == 0) {
        first_loss = got_loss;
        first_lse = got_lse;
        first_dx = got_dx;
        first_dw = got_dw;
      } else {
        CHECK(bitwise_equal(got_loss, first_loss));
        CHECK(bitwise_equal(got_lse, first_lse));
        CHECK(bitwise_equal(got_dx, first_dx));
        CHECK(bitwise_equal(got_dw, first_dw));
      }
    }
  }
}

TEST_CASE("cuda lmhead_ce: all targets masked give zero loss and dx, dw unchanged", "[gpu][gemm]") {
  MOP_REQUIRE_GPU();
  CudaOps ops;
  // Every target masked: loss 0, dx 0, dw unchanged (bitwise), lse still the row's log-sum-exp.
  const LmCase c{6, 16, 40, 4};
  HostTensor x = dyadic_tensor({c.tokens, c.hidden}, 7), w = dyadic_tensor({c.vocab, c.hidden}, 8);
  HostTensor targets(DType::I32, {c.tokens});
  for (int64_t t = 0; t < c.tokens; ++t) targets.ptr<int32_t>()[t] = -1;
  HostTensor dw0 = dyadic_tensor({c.vocab, c.hidden}, 9);
  HostTensor loss_ref(DType::F32, {c.tokens}), lse_ref(DType::F32, {c.tokens});
  HostTensor ws_ref(DType::F32, {c.chunk, c.vocab});
  cpu_ops().lmhead_ce_fwd(loss_ref, lse_ref, x, w, targets, ws_ref);

  DeviceTensor d_x = upload(x, DType::BF16), d_w = upload(w, DType::BF16), d_t = upload(targets);
  DeviceTensor ws(DType::F32, {c.chunk, c.vocab}), loss(DType::F32, {c.tokens});
  DeviceTensor lse(DType::F32, {c.tokens}), dx(DType::BF16, {c.tokens, c.hidden});
  DeviceTensor dw = upload(dw0, DType::F32);
  for (const DeviceTensor* t : {&loss, &lse, &dx}) poison(*t);
  ops.lmhead_ce_fwd(loss, lse, d_x, d_w, d_t, ws);
  ops.lmhead_ce_bwd(dx, dw, d_x, d_w, d_t, lse, 1.0f, ws);
  // count_mismatches, not max_abs: a NaN left by the poison must count.
  CHECK(count_mismatches(download(loss), HostTensor(DType::F32, {c.tokens}), 0, 0) == 0);
  CHECK(count_mismatches(download(lse), lse_ref, lse_atol(c.vocab), 0) == 0);
  CHECK(count_mismatches(download(dx), HostTensor(DType::F32, {c.tokens, c.hidden}), 0, 0) == 0);
  CHECK(bitwise_equal(download(dw), dw0));
}

#endif  // MOP_HAVE_CUDA
