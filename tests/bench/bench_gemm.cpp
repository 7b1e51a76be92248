// GEMM family benchmarks (mop_bench gemm | grouped | lmhead): the dense ceiling (8192³), the
// q3moe-8l dense shapes at T = 4096, the grouped expert GEMMs on each path (every path, or only the
// one MOP_GROUPED_GEMM names when it is set; MOP_GROUPED_GEMM_CONFIG picks the CUTLASS tiles), and
// the fused LM head + cross-entropy. Each case first checks sampled outputs against fp64 sums of
// the same bf16 inputs (with a rigorous fp32-accumulation bound), then times.
// FLOPs: 2·M·N·K per GEMM; grouped: 2·R·N·K over all R routed rows; LM head: forward 2·T·V·H,
// backward 3 × 2·T·V·H (logits recomputed, dx, dw). Inputs have full 8-bit mantissas: random data
// draws more power than zeros (measured on the H200 machine: ~790 vs ~900 TFLOP/s at 8192³).
#include "bench.h"

#ifdef MOP_HAVE_CUDA

#include <stdlib.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "runtime/cuda_check.h"
#include "runtime/memory.h"
#include "ops/cuda_ops.h"

namespace mop::bench {
namespace {

constexpr double kAddUlp = 1.0 / (1 << 23);  // fp32 accumulation, 1 ulp per addition
constexpr double kBf16Ulp = 1.0 / 128;       // one bf16 rounding of the output
constexpr int kSamples = 256;                // output elements checked per case

// q3moe-8l
constexpr int64_t kTokens = 4096, kHidden = 2048, kHeads = 32, kKvHeads = 4, kHeadDim = 128;
constexpr int64_t kExperts = 128, kExpertFfn = 768, kVocab = 151936, kLmChunk = 1024;

uint64_t splitmix(uint64_t z) {
  z += 0x9e3779b97f4a7c15ull;
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

// Uniform in [−scale, scale), rounded to bf16.
std::vector<bf16> random_bf16(int64_t n, uint64_t seed, float scale) {
  std::vector<bf16> v(static_cast<size_t>(n));
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < n; ++i) {
    const float u = float(splitmix(seed * 0x100000001b3ull + uint64_t(i)) >> 40) / float(1 << 24);
    v[size_t(i)] = float_to_bf16(scale * (2 * u - 1));
  }
  return v;
}

// A device tensor with its own allocation (zero-filled).
struct Dev {
  Buffer buf;
  Tensor t;
  Dev(DType dtype, std::initializer_list<int64_t> dims) {
    t = Tensor(nullptr, dtype, dims, Device::CUDA);
    buf = Buffer(MemKind::Device, std::max<size_t>(t.bytes(), 1));
    t.data = buf.data();
  }
  operator Tensor() const { return t; }
};

template <class T>
void to_device(const Tensor& d, const std::vector<T>& h) {
  MOP_CHECK(d.bytes() == h.size() * sizeof(T), "to_device: size");
  MOP_CUDA_CHECK(cudaMemcpy(d.data, h.data(), d.bytes(), cudaMemcpyHostToDevice));
}

template <class T>
std::vector<T> from_device(const Tensor& d) {
  std::vector<T> h(d.bytes() / sizeof(T));
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
  MOP_CUDA_CHECK(cudaMemcpy(h.data(), d.data, d.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// Element i of a downloaded bf16 or f32 tensor.
struct HostOut {
  DType dtype;
  std::vector<uint8_t> bytes;
  explicit HostOut(const Tensor& d) : dtype(d.dtype), bytes(from_device<uint8_t>(d)) {}
  double get(int64_t i) const {
    if (dtype == DType::F32) return reinterpret_cast<const float*>(bytes.data())[i];
    return bf16_to_float(reinterpret_cast<const bf16*>(bytes.data())[i]);
  }
};

double f(bf16 x) {
  return double(bf16_to_float(x));
}

// |got − ref| ≤ 2·K·ulp·Σ|terms| (+ one bf16 rounding): the sum order of each side is free.
bool within(double got, double ref, double abs_sum, int64_t k, DType out) {
  const double tol = 2 * double(k) * kAddUlp * abs_sum +
                     (out == DType::BF16 ? kBf16Ulp * std::fabs(ref) : 0.0) + 1e-30;
  return std::fabs(got - ref) <= tol;
}

void set_path(const std::string& path) {
  setenv("MOP_GROUPED_GEMM", path.c_str(), 1);
}

// The grouped paths to time: MOP_GROUPED_GEMM as given when mop_bench started, or all of them.
const std::vector<std::string>& grouped_paths() {
  static const std::vector<std::string> paths = [] {
    const char* v = getenv("MOP_GROUPED_GEMM");
    if (v && *v) return std::vector<std::string>{v};
    return std::vector<std::string>{"cutlass", "grouped", "loop", "streams"};
  }();
  return paths;
}

// ---- dense -------------------------------------------------------------------------------------

// c[m,n] (+)= op(a)·op(b); beta = 1 for weight gradients (fp32 C), 0 otherwise.
void bench_dense(const std::string& name, int64_t m, int64_t n, int64_t k, bool ta, bool tb,
                 DType c_dtype, float beta) {
  CudaOps ops;
  const std::vector<bf16> ha = random_bf16(m * k, 1, 1), hb = random_bf16(k * n, 2, 1);
  Dev a(DType::BF16, {ta ? k : m, ta ? m : k}), b(DType::BF16, {tb ? n : k, tb ? k : n});
  Dev c(c_dtype, {m, n});
  to_device(a.t, ha);
  to_device(b.t, hb);
  ops.gemm(c, a, ta, b, tb, 1, beta);  // c starts at zero, so beta = 1 checks the same values
  const HostOut got(c.t);
  bool valid = true;
  for (int s = 0; s < kSamples; ++s) {
    const int64_t i = int64_t(splitmix(uint64_t(3 * s)) % uint64_t(m));
    const int64_t j = int64_t(splitmix(uint64_t(3 * s + 1)) % uint64_t(n));
    double ref = 0, abs_sum = 0;
    for (int64_t kk = 0; kk < k; ++kk) {
      const double x = f(ha[size_t(ta ? kk * m + i : i * k + kk)]);
      const double y = f(hb[size_t(tb ? j * k + kk : kk * n + j)]);
      ref += x * y;
      abs_sum += std::fabs(x * y);
    }
    valid = valid && within(got.get(i * n + j), ref, abs_sum, k, c_dtype);
  }
  const double ms = time_ms([&] { ops.gemm(c, a, ta, b, tb, 1, beta); }, ops.cuda_stream());
  report(name, valid, ms, 2.0 * double(m) * double(n) * double(k), 0, kGemmTflops);
}

MOP_BENCH("gemm 8192x8192x8192 bf16 x·Wᵀ (ceiling)") {
  bench_dense("gemm 8192^3 bf16 x.W^T", 8192, 8192, 8192, false, true, DType::BF16, 0);
}

MOP_BENCH("gemm q3moe-8l dense shapes, T = 4096") {
  const int64_t q = kHeads * kHeadDim, kv = kKvHeads * kHeadDim;
  bench_dense("gemm q proj fwd    4096x4096x2048", kTokens, q, kHidden, false, true, DType::BF16,
              0);
  bench_dense("gemm k/v proj fwd  4096x512x2048", kTokens, kv, kHidden, false, true, DType::BF16,
              0);
  bench_dense("gemm o proj fwd    4096x2048x4096", kTokens, kHidden, q, false, true, DType::BF16,
              0);
  bench_dense("gemm router fwd    4096x128x2048 f32", kTokens, kExperts, kHidden, false, true,
              DType::F32, 0);
  bench_dense("gemm q proj dgrad  4096x2048x4096", kTokens, kHidden, q, false, false, DType::BF16,
              0);
  bench_dense("gemm q proj wgrad  4096x2048x4096 f32+=", q, kHidden, kTokens, true, false,
              DType::F32, 1);
  bench_dense("gemm lm head chunk 1024x151936x2048 f32", kLmChunk, kVocab, kHidden, false, true,
              DType::F32, 0);
  bench_dense("gemm lm head dgrad 1024x2048x151936", kLmChunk, kHidden, kVocab, false, false,
              DType::BF16, 0);
  bench_dense("gemm lm head wgrad 151936x2048x1024 f32+=", kVocab, kHidden, kLmChunk, true, false,
              DType::F32, 1);
}

// ---- grouped -----------------------------------------------------------------------------------

// The isolated time above (L2 flushed, one call) counts whatever the host spends enqueueing a call
// beyond the flush's head start. This adds the other view, a training step's: the rate of 10
// back-to-back calls (no flush; the inputs exceed L2 anyway) and the host time to enqueue one.
std::string back_to_back(const std::function<void()>& fn, cudaStream_t stream, double flops) {
  constexpr int kCalls = 10;
  cudaEvent_t start, stop;
  MOP_CUDA_CHECK(cudaEventCreate(&start));
  MOP_CUDA_CHECK(cudaEventCreate(&stop));
  MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  MOP_CUDA_CHECK(cudaEventRecord(start, stream));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < kCalls; ++i) fn();
  const auto t1 = std::chrono::steady_clock::now();
  MOP_CUDA_CHECK(cudaEventRecord(stop, stream));
  MOP_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  MOP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  const double host_us = std::chrono::duration<double, std::micro>(t1 - t0).count() / kCalls;
  char buf[96];
  std::snprintf(buf, sizeof buf, "; back-to-back %.1f TFLOP/s, host %.0f us/call",
                flops * kCalls / ms / 1e9, host_us);
  return buf;
}

// E experts (default 128) × `rows` each; w [E,N,K]. fwd y = x·wᵀ, bwd_data dx = dy·w, bwd_weight
// dw += dyᵀ·x.
void bench_grouped(const char* shape, int64_t n, int64_t k, int64_t rows,
                   int64_t e_count = kExperts) {
  CudaOps ops;
  const int64_t r_total = e_count * rows;
  const std::vector<bf16> hx = random_bf16(r_total * k, 11, 1),
                          hw = random_bf16(e_count * n * k, 12, 1);
  const std::vector<bf16> hdy = random_bf16(r_total * n, 13, 1);
  Dev x(DType::BF16, {r_total, k}), w(DType::BF16, {e_count, n, k}), dy(DType::BF16, {r_total, n});
  Dev y(DType::BF16, {r_total, n}), dx(DType::BF16, {r_total, k}), dw(DType::F32, {e_count, n, k});
  to_device(x.t, hx);
  to_device(w.t, hw);
  to_device(dy.t, hdy);
  std::vector<int32_t> offs(static_cast<size_t>(e_count + 1));
  for (int64_t e = 0; e <= e_count; ++e) offs[size_t(e)] = int32_t(e * rows);
  const Tensor offsets(offs.data(), DType::I32, {e_count + 1}, Device::CPU);
  const double flops = 2.0 * double(r_total) * double(n) * double(k);
  const std::string tag =
      std::string(shape) + " E" + std::to_string(e_count) + "x" + std::to_string(rows);
  auto sample = [&](int s, int64_t mod) { return int64_t(splitmix(uint64_t(s)) % uint64_t(mod)); };

  const char* config = getenv("MOP_GROUPED_GEMM_CONFIG");
  for (const std::string& path : grouped_paths()) {
    set_path(path);
    std::string note = "MOP_GROUPED_GEMM=" + path;
    if (path == "cutlass" && config && *config)
      note += " MOP_GROUPED_GEMM_CONFIG=" + std::string(config);
    // fwd: y[r,j] = Σ_k x[r,k]·w[e,j,k]
    ops.grouped_gemm_fwd(y, x, w, offsets);
    {
      const HostOut got(y.t);
      bool valid = true;
      for (int s = 0; s < kSamples; ++s) {
        const int64_t r = sample(2 * s, r_total), j = sample(2 * s + 1, n), e = r / rows;
        double ref = 0, abs_sum = 0;
        for (int64_t kk = 0; kk < k; ++kk) {
          const double p = f(hx[size_t(r * k + kk)]) * f(hw[size_t((e * n + j) * k + kk)]);
          ref += p;
          abs_sum += std::fabs(p);
        }
        valid = valid && within(got.get(r * n + j), ref, abs_sum, k, DType::BF16);
      }
      const auto fn = [&] { ops.grouped_gemm_fwd(y, x, w, offsets); };
      const double ms = time_ms(fn, ops.cuda_stream());
      report("grouped fwd        " + tag, valid, ms, flops, 0, kGemmTflops,
             note + back_to_back(fn, ops.cuda_stream(), flops));
    }
    // bwd_data: dx[r,kk] = Σ_j dy[r,j]·w[e,j,kk]
    ops.grouped_gemm_bwd_data(dx, dy, w, offsets);
    {
      const HostOut got(dx.t);
      bool valid = true;
      for (int s = 0; s < kSamples; ++s) {
        const int64_t r = sample(2 * s, r_total), kk = sample(2 * s + 1, k), e = r / rows;
        double ref = 0, abs_sum = 0;
        for (int64_t j = 0; j < n; ++j) {
          const double p = f(hdy[size_t(r * n + j)]) * f(hw[size_t((e * n + j) * k + kk)]);
          ref += p;
          abs_sum += std::fabs(p);
        }
        valid = valid && within(got.get(r * k + kk), ref, abs_sum, n, DType::BF16);
      }
      const auto fn = [&] { ops.grouped_gemm_bwd_data(dx, dy, w, offsets); };
      const double ms = time_ms(fn, ops.cuda_stream());
      report("grouped bwd_data   " + tag, valid, ms, flops, 0, kGemmTflops,
             note + back_to_back(fn, ops.cuda_stream(), flops));
    }
    // bwd_weight: dw[e,j,kk] += Σ_{r of e} dy[r,j]·x[r,kk], from zero for the check; and written
    // (the first micro-batch of a step), over a poisoned dw.
    for (const bool accumulate : {true, false}) {
      MOP_CUDA_CHECK(cudaMemsetAsync(dw.t.data, accumulate ? 0 : 0xFF, dw.t.bytes(), ops.cuda_stream()));
      ops.grouped_gemm_bwd_weight(dw, dy, x, offsets, accumulate);
      const HostOut got(dw.t);
      bool valid = true;
      for (int s = 0; s < kSamples; ++s) {
        const int64_t e = sample(3 * s, e_count), j = sample(3 * s + 1, n),
                      kk = sample(3 * s + 2, k);
        double ref = 0, abs_sum = 0;
        for (int64_t r = e * rows; r < (e + 1) * rows; ++r) {
          const double p = f(hdy[size_t(r * n + j)]) * f(hx[size_t(r * k + kk)]);
          ref += p;
          abs_sum += std::fabs(p);
        }
        valid = valid && within(got.get((e * n + j) * k + kk), ref, abs_sum, rows, DType::F32);
      }
      const auto fn = [&] { ops.grouped_gemm_bwd_weight(dw, dy, x, offsets, accumulate); };
      const double ms = time_ms(fn, ops.cuda_stream());
      report(std::string(accumulate ? "grouped bwd_weight " : "grouped bwd_wt=    ") + tag, valid, ms,
             flops, 0, kGemmTflops,
             note + (path == "grouped" ? " (fp32 C: runs the loop)" : "") +
                 back_to_back(fn, ops.cuda_stream(), flops));
    }
  }
  unsetenv("MOP_GROUPED_GEMM");
  // The same FLOPs as one dense GEMM (expert 0's weights for every row): what a grouped kernel
  // could reach.
  const Tensor w0 = w.t.at(0);
  const auto fn = [&] { ops.gemm(y, x, false, w0, true, 1, 0); };
  const double ms = time_ms(fn, ops.cuda_stream());
  report("dense same FLOPs   " + tag, true, ms, flops, 0, kGemmTflops,
         "one gemm [R,K].[N,K]^T" + back_to_back(fn, ops.cuda_stream(), flops));
}

MOP_BENCH("grouped_gemm q3moe-8l experts") {
  for (int64_t rows : {256, 1024}) {
    bench_grouped("gate_up 2048->1536", 2 * kExpertFfn, kHidden, rows);
    bench_grouped("down     768->2048", kHidden, kExpertFfn, rows);
  }
}

// configs/moe-1t.yaml's experts as one rank of its 96-GPU plan runs them: 384 experts over ep 12
// (32 per rank), hidden 4096, FFN 2048, the exchange in 4 chunks of 2,048 rows per expert.
MOP_BENCH("grouped_gemm moe-1t experts") {
  bench_grouped("gate_up 4096->4096", 4096, 4096, 2048, 32);
  bench_grouped("down    2048->4096", 4096, 2048, 2048, 32);
}

// ---- fused LM head + cross-entropy
// ---------------------------------------------------------------

MOP_BENCH("lmhead q3moe-8l T = 4096, chunk 1024") {
  CudaOps ops;
  const int64_t t_count = kTokens, h = kHidden, v_count = kVocab;
  // w small enough that logits are O(1), as in a trained model.
  const std::vector<bf16> hx = random_bf16(t_count * h, 21, 1),
                          hw = random_bf16(v_count * h, 22, 0.05f);
  std::vector<int32_t> ht(static_cast<size_t>(t_count));
  for (int64_t t = 0; t < t_count; ++t)
    ht[size_t(t)] = t % 20 == 19 ? -1 : int32_t(splitmix(uint64_t(t) + 99) % uint64_t(v_count));
  Dev x(DType::BF16, {t_count, h}), w(DType::BF16, {v_count, h}), targets(DType::I32, {t_count});
  Dev ws(DType::F32, {kLmChunk, v_count}), loss(DType::F32, {t_count}), lse(DType::F32, {t_count});
  Dev dx(DType::BF16, {t_count, h}), dw(DType::F32, {v_count, h});
  to_device(x.t, hx);
  to_device(w.t, hw);
  to_device(targets.t, ht);
  const float grad_scale = 1.0f / float(t_count);
  ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws);
  ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, grad_scale, ws);
  const std::vector<float> got_loss = from_device<float>(loss.t),
                           got_lse = from_device<float>(lse.t);
  const HostOut got_dx(dx.t), got_dw(dw.t);

  // z[t,v] in fp64 with the bound of its fp32 accumulation error.
  auto logit = [&](int64_t t, int64_t v, double* err) {
    double z = 0, abs_sum = 0;
    for (int64_t i = 0; i < h; ++i) {
      const double p = f(hx[size_t(t * h + i)]) * f(hw[size_t(v * h + i)]);
      z += p;
      abs_sum += std::fabs(p);
    }
    if (err) *err = 2 * double(h) * kAddUlp * abs_sum;
    return z;
  };
  bool valid = true;
  for (int64_t t : {int64_t(0), int64_t(19), int64_t(1000), t_count - 1}) {
    std::vector<double> z(static_cast<size_t>(v_count)), err(static_cast<size_t>(v_count));
#pragma omp parallel for schedule(static)
    for (int64_t v = 0; v < v_count; ++v) z[size_t(v)] = logit(t, v, &err[size_t(v)]);
    double m = -INFINITY, s = 0, max_err = 0;
    for (int64_t v = 0; v < v_count; ++v) {
      m = std::max(m, z[size_t(v)]);
      max_err = std::max(max_err, err[size_t(v)]);
    }
    for (int64_t v = 0; v < v_count; ++v) s += std::exp(z[size_t(v)] - m);
    const double ref_lse = m + std::log(s), tol = 2 * max_err + double(v_count) * kAddUlp;
    const int32_t target = ht[size_t(t)];
    const double ref_loss = target < 0 ? 0.0 : ref_lse - z[size_t(target)];
    valid = valid && std::fabs(got_lse[size_t(t)] - ref_lse) <= tol &&
            std::fabs(got_loss[size_t(t)] - ref_loss) <= 2 * tol;
    // dx[t,i] = Σ_v dl[t,v]·w[v,i]; dlogits are bf16 (2^-9) and p carries the logits' error.
    for (int64_t i = 0; i < h; i += 97) {
      double ref = 0, abs_sum = 0;
      for (int64_t v = 0; v < v_count && target >= 0; ++v) {
        const double p = std::exp(z[size_t(v)] - ref_lse);
        const double dl = ((v == target ? p - 1 : p) * grad_scale);
        ref += dl * f(hw[size_t(v * h + i)]);
        abs_sum += (std::fabs(dl) + p * grad_scale) * std::fabs(f(hw[size_t(v * h + i)]));
      }
      const double dx_tol = (1.0 / 256 + 2 * tol) * abs_sum + kBf16Ulp * std::fabs(ref) + 1e-30;
      valid = valid && std::fabs(got_dx.get(t * h + i) - ref) <= dx_tol;
    }
  }
  // dw[v,i] = Σ_t dl[t,v]·x[t,i] for a few (v, i), with the device's lse.
  for (int s = 0; s < 8; ++s) {
    const int64_t v = int64_t(splitmix(uint64_t(s) + 7) % uint64_t(v_count)), i = (s * 263) % h;
    double ref = 0, abs_sum = 0, max_err = 0;
    for (int64_t t = 0; t < t_count; ++t) {
      if (ht[size_t(t)] < 0) continue;
      double err = 0;
      const double p = std::exp(logit(t, v, &err) - got_lse[size_t(t)]);
      const double dl = (v == ht[size_t(t)] ? p - 1 : p) * grad_scale;
      ref += dl * f(hx[size_t(t * h + i)]);
      abs_sum += (std::fabs(dl) + p * grad_scale) * std::fabs(f(hx[size_t(t * h + i)]));
      max_err = std::max(max_err, err);
    }
    const double dw_tol = (1.0 / 256 + 4 * max_err + 1e-4) * abs_sum + 1e-30;
    valid = valid && std::fabs(got_dw.get(v * h + i) - ref) <= dw_tol;
  }

  const double fwd_flops = 2.0 * double(t_count) * double(v_count) * double(h);
  const double fwd_ms =
      time_ms([&] { ops.lmhead_ce_fwd(loss, lse, x, w, targets, ws); }, ops.cuda_stream());
  report("lmhead_ce fwd T4096 V151936 H2048 chunk 1024", valid, fwd_ms, fwd_flops, 0, kGemmTflops);
  const double bwd_ms =
      time_ms([&] { ops.lmhead_ce_bwd(dx, dw, x, w, targets, lse, grad_scale, ws); }, ops.cuda_stream());
  report("lmhead_ce bwd T4096 V151936 H2048 chunk 1024", valid, bwd_ms, 3 * fwd_flops, 0,
         kGemmTflops, "recomputes logits; dx, dw += per chunk");
}

}  // namespace
}  // namespace mop::bench

#endif  // MOP_HAVE_CUDA
