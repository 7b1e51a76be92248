// Attention benchmarks (mop_bench attention): cuDNN flash attention forward and backward through
// CudaOps at the q3moe-8l shapes — B=1, S=4096 and 16384, Nq=32, Nkv=4, D=128, causal — with the
// default backward and with the deterministic one (MOP_ATTN_DETERMINISTIC=1, which trades a
// B·Nq·S² bf16 workspace for bitwise-reproducible dq). Each mode is validated first against the CPU
// reference at S=512 (the reference at S=16384 would take minutes).
// FLOPs (2 per multiply-add; causal keeps half of the S² scores):
//   forward  = 4·B·Nq·S²·D / 2   (QKᵀ and P·V: two S²·D GEMMs per head)
//   backward = 2.5 × forward     (QKᵀ recomputed, dP = dO·Vᵀ, dV = Pᵀ·dO, dK = dSᵀ·Q, dQ = dS·K)
// attention_tiled: the causal and full blocks of 16K–128K tokens that attention in query tiles
// (model/tiled_attention.h) is made of, and one sequence of 256K tokens whole and in tiles of
// 64K, 32K and 16K (one timed call each after one untimed).
#ifdef MOP_HAVE_CUDA

#include <stdlib.h>

#include <algorithm>
#include <cmath>
#include <string>

#include "bench.h"
#include "runtime/cuda_check.h"
#include "core/rng.h"
#include "gpu/gpu_test_util.h"
#include "model/tiled_attention.h"
#include "ops/cuda_ops.h"

namespace mop::bench {
namespace {

using test::DeviceTensor;
using test::HostTensor;

// Same bounds as tests/gpu/attention_test.cpp (reasons there): bf16 unit roundoff u = 2^-8, two
// roundings on out, about four on the gradients.
constexpr double kOutRtol = 2.0 / 256, kOutAtolPerMaxV = 2.0 / 256, kOutNmse = 2e-5;
constexpr double kLseAtol = 1e-4, kLseNmse = 1e-8;
constexpr double kGradRtol = 1.0 / 64, kGradAtolPerMax = 1.0 / 64, kGradNmse = 1e-4;

constexpr int64_t kHeads = 32, kKvHeads = 4, kHeadDim = 128;  // q3moe-8l
constexpr int64_t kValidateSeq = 512;

struct Shape {
  int batch;
  int64_t seq;
  int64_t tokens() const { return batch * seq; }
  float scale() const { return float(1.0 / std::sqrt(double(kHeadDim))); }
  std::string str() const {
    return "B=" + std::to_string(batch) + " S=" + std::to_string(seq) +
           " Nq=" + std::to_string(kHeads) + " Nkv=" + std::to_string(kKvHeads) +
           " D=" + std::to_string(kHeadDim);
  }
};

// Sets MOP_ATTN_DETERMINISTIC for one scope; it is read when a CudaOps first runs attention.
class DeterministicEnv {
 public:
  explicit DeterministicEnv(bool on) {
    if (const char* old = getenv("MOP_ATTN_DETERMINISTIC")) {
      old_ = old;
      had_ = true;
    }
    setenv("MOP_ATTN_DETERMINISTIC", on ? "1" : "0", 1);
  }
  ~DeterministicEnv() {
    if (had_)
      setenv("MOP_ATTN_DETERMINISTIC", old_.c_str(), 1);
    else
      unsetenv("MOP_ATTN_DETERMINISTIC");
  }

 private:
  std::string old_;
  bool had_ = false;
};

// Uniform values in [lo, hi) rounded to bf16, as a host tensor of dtype `dtype` (bf16 for the big
// timing inputs, f32 for the reference's); generated in parallel, a pure function of (seed, i).
HostTensor random_tensor(DType dtype, std::initializer_list<int64_t> dims, uint64_t seed, double lo,
                         double hi) {
  HostTensor t(dtype, dims);
  const int64_t n = t.numel();
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const double u = double(philox_u64(seed, 3, uint64_t(i)) >> 11) / 9007199254740992.0;
    t.set(i, round_bf16(float(lo + (hi - lo) * u)));
  }
  return t;
}

// Pageable uploads and the poison memset may still be in flight on the legacy stream; CudaOps'
// non-blocking stream does not wait for it.
void settle() {
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
}

bool within(const HostTensor& got, const HostTensor& ref, double atol, double rtol,
            double max_nmse) {
  return test::count_mismatches(got, ref, atol, rtol) == 0 && test::nmse(got, ref) < max_nmse;
}

double max_abs(const HostTensor& x) {
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(x.get(i)));
  return m;
}

// Forward and backward at S = kValidateSeq against the CPU reference (poisoned outputs).
bool validate(CudaOps& ops) {
  const Shape s{1, kValidateSeq};
  const int64_t t = s.tokens();
  HostTensor q = random_tensor(DType::F32, {t, kHeads, kHeadDim}, 11, -2, 2);
  HostTensor k = random_tensor(DType::F32, {t, kKvHeads, kHeadDim}, 12, -2, 2);
  HostTensor v = random_tensor(DType::F32, {t, kKvHeads, kHeadDim}, 13, -1, 1);
  HostTensor dout = random_tensor(DType::F32, {t, kHeads, kHeadDim}, 14, -1, 1);
  HostTensor out(DType::F32, {t, kHeads, kHeadDim}), lse(DType::F32, {s.batch, kHeads, s.seq});
  HostTensor dq = out, dk = k, dv = v;
  auto cpu = make_cpu_ops();
  cpu->attention_fwd(out, lse, q, k, v, s.batch, s.scale(), true);
  cpu->attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, s.batch, s.scale(), true);

  DeviceTensor gq = test::upload(q, DType::BF16), gk = test::upload(k, DType::BF16);
  DeviceTensor gv = test::upload(v, DType::BF16), gdout = test::upload(dout, DType::BF16);
  DeviceTensor gout(DType::BF16, {t, kHeads, kHeadDim}), glse(DType::F32, {s.batch, kHeads, s.seq});
  DeviceTensor gdq(DType::BF16, {t, kHeads, kHeadDim}), gdk(DType::BF16, {t, kKvHeads, kHeadDim});
  DeviceTensor gdv(DType::BF16, {t, kKvHeads, kHeadDim});
  for (const DeviceTensor* x : {&gout, &glse, &gdq, &gdk, &gdv}) test::poison(*x);
  settle();
  ops.attention_fwd(gout, glse, gq, gk, gv, s.batch, s.scale(), true);
  ops.attention_bwd(gdq, gdk, gdv, gdout, gq, gk, gv, gout, glse, s.batch, s.scale(), true);
  return within(test::download(gout), out, kOutAtolPerMaxV * max_abs(v), kOutRtol, kOutNmse) &&
         within(test::download(glse), lse, kLseAtol, 0, kLseNmse) &&
         within(test::download(gdq), dq, kGradAtolPerMax * max_abs(dq), kGradRtol, kGradNmse) &&
         within(test::download(gdk), dk, kGradAtolPerMax * max_abs(dk), kGradRtol, kGradNmse) &&
         within(test::download(gdv), dv, kGradAtolPerMax * max_abs(dv), kGradRtol, kGradNmse);
}

// Times forward (when asked) and backward at one shape on random bf16 inputs.
void time_shape(CudaOps& ops, const Shape& s, bool valid, bool with_fwd, const std::string& mode) {
  const int64_t t = s.tokens();
  DeviceTensor q = test::upload(random_tensor(DType::BF16, {t, kHeads, kHeadDim}, 21, -2, 2));
  DeviceTensor k = test::upload(random_tensor(DType::BF16, {t, kKvHeads, kHeadDim}, 22, -2, 2));
  DeviceTensor v = test::upload(random_tensor(DType::BF16, {t, kKvHeads, kHeadDim}, 23, -1, 1));
  DeviceTensor dout = test::upload(random_tensor(DType::BF16, {t, kHeads, kHeadDim}, 24, -1, 1));
  DeviceTensor out(DType::BF16, {t, kHeads, kHeadDim}), lse(DType::F32, {s.batch, kHeads, s.seq});
  DeviceTensor dq(DType::BF16, {t, kHeads, kHeadDim}), dk(DType::BF16, {t, kKvHeads, kHeadDim});
  DeviceTensor dv(DType::BF16, {t, kKvHeads, kHeadDim});
  settle();
  auto fwd = [&] { ops.attention_fwd(out, lse, q, k, v, s.batch, s.scale(), true); };
  auto bwd = [&] { ops.attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, s.batch, s.scale(), true); };
  fwd();  // builds both plans (host work) and gives the backward its out and lse
  bwd();
  ops.synchronize();
  const double fwd_flops = 4.0 * s.batch * kHeads * double(s.seq) * double(s.seq) * kHeadDim / 2;
  if (with_fwd)
    report("attention_fwd " + s.str() + mode, valid, time_ms(fwd, ops.cuda_stream()), fwd_flops, 0,
           kAttnFwdTflops);
  report("attention_bwd " + s.str() + mode, valid, time_ms(bwd, ops.cuda_stream()), 2.5 * fwd_flops, 0,
         kAttnBwdTflops, "CudaOps workspace " + format_bytes(double(ops.workspace_bytes())));
}

void run_mode(bool deterministic) {
  DeterministicEnv env(deterministic);
  const std::string mode = deterministic ? " deterministic" : "";
  bool valid = false;
  {
    CudaOps ops;
    valid = validate(ops);
  }
  for (int64_t seq : {4096, 16384}) {
    CudaOps ops;  // fresh: the reported workspace is this shape's alone
    time_shape(ops, Shape{1, seq}, valid, !deterministic, mode);
  }
}

// Seconds of one call of fn after one untimed call (plans, workspace): the long shapes below run
// for seconds, so one timed call is already steady.
double once_ms(const std::function<void()>& fn, cudaStream_t stream) {
  return time_ms(fn, stream, /*iters=*/1, /*warmup=*/1);
}

// Long sequences: the causal and non-causal blocks attention in query tiles is made of, at the
// tile sizes the plan chooses between, and one sequence of S tokens whole against its tiles.
void time_tiled() {
  for (bool causal : {true, false})
    for (int64_t c : {16384, 32768, 65536, 131072}) {
      CudaOps ops;
      DeviceTensor q = test::upload(random_tensor(DType::BF16, {c, kHeads, kHeadDim}, 31, -2, 2));
      DeviceTensor k = test::upload(random_tensor(DType::BF16, {c, kKvHeads, kHeadDim}, 32, -2, 2));
      DeviceTensor v = test::upload(random_tensor(DType::BF16, {c, kKvHeads, kHeadDim}, 33, -1, 1));
      DeviceTensor out(DType::BF16, {c, kHeads, kHeadDim}), lse(DType::F32, {1, kHeads, c});
      DeviceTensor dq(DType::BF16, {c, kHeads, kHeadDim}), dk(DType::BF16, {c, kKvHeads, kHeadDim});
      DeviceTensor dv(DType::BF16, {c, kKvHeads, kHeadDim});
      settle();
      const float scale = float(1.0 / std::sqrt(double(kHeadDim)));
      auto fwd = [&] { ops.attention_fwd(out, lse, q, k, v, 1, scale, causal); };
      auto bwd = [&] { ops.attention_bwd(dq, dk, dv, out, q, k, v, out, lse, 1, scale, causal); };
      const double f = 4.0 * kHeads * double(c) * double(c) * kHeadDim * (causal ? 0.5 : 1.0);
      const std::string name = std::string(causal ? "causal" : "full") + " S=" + std::to_string(c);
      report("attention_fwd block " + name, true, once_ms(fwd, ops.cuda_stream()), f, 0, kAttnFwdTflops);
      report("attention_bwd block " + name, true, once_ms(bwd, ops.cuda_stream()), 2.5 * f, 0, kAttnBwdTflops,
             "CudaOps workspace " + format_bytes(double(ops.workspace_bytes())));
    }
  const int64_t S = 262144;
  for (int64_t tile : {int64_t(0), int64_t(65536), int64_t(32768), int64_t(16384)}) {
    CudaOps ops;
    DeviceTensor q = test::upload(random_tensor(DType::BF16, {S, kHeads, kHeadDim}, 41, -2, 2));
    DeviceTensor k = test::upload(random_tensor(DType::BF16, {S, kKvHeads, kHeadDim}, 42, -2, 2));
    DeviceTensor v = test::upload(random_tensor(DType::BF16, {S, kKvHeads, kHeadDim}, 43, -1, 1));
    DeviceTensor out(DType::BF16, {S, kHeads, kHeadDim}), lse(DType::F32, {S * kHeads});
    DeviceTensor dq(DType::BF16, {S, kHeads, kHeadDim}), dk(DType::BF16, {S, kKvHeads, kHeadDim});
    DeviceTensor dv(DType::BF16, {S, kKvHeads, kHeadDim});
    settle();
    TiledAttention tiled(ops, tile, S, kHeads, kKvHeads, kHeadDim, DType::BF16);
    const float scale = float(1.0 / std::sqrt(double(kHeadDim)));
    auto fwd = [&] { tiled.forward(out, lse, q, k, v, 1, scale); };
    auto bwd = [&] { tiled.backward(dq, dk, dv, out, q, k, v, out, lse, 1, scale); };
    const double f = 4.0 * kHeads * double(S) * double(S) * kHeadDim / 2;
    const std::string name = "S=" + std::to_string(S) + (tile ? " tile " + std::to_string(tile) : " whole");
    const std::string mem = "workspace " + format_bytes(double(ops.workspace_bytes())) + ", tile buffers " +
                            format_bytes(double(TiledAttention::buffer_bytes(tile, S, kHeads, kKvHeads,
                                                                              kHeadDim, DType::BF16)));
    report("attention_fwd tiled " + name, true, once_ms(fwd, ops.cuda_stream()), f, 0, kAttnFwdTflops);
    report("attention_bwd tiled " + name, true, once_ms(bwd, ops.cuda_stream()), 2.5 * f, 0, kAttnBwdTflops,
           mem + " (after both passes: " + format_bytes(double(ops.workspace_bytes())) + ")");
  }
}

}  // namespace

MOP_BENCH("attention") {
  run_mode(false);
}
MOP_BENCH("attention_deterministic") {
  run_mode(true);
}
MOP_BENCH("attention_tiled") {
  time_tiled();
}

}  // namespace mop::bench

#endif  // MOP_HAVE_CUDA
