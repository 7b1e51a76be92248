// The benchmark program (mop_bench [filter]): one case per op or measurement, named by the op's
// stem first (`mop_bench rmsnorm`). A GPU case validates its kernel against the CPU reference
// first, then times it with CUDA events (L2 flushed before every timed launch) and prints time,
// TFLOP/s or GB/s and the percentage of the H200 ceiling measured on the H200 machine; a CPU case
// times the CPU reference (best of a few runs) after checking its output is finite and nonzero.
// CPU cases run in every build; GPU cases where a GPU is (MOP_BENCH in a MOP_HAVE_CUDA block).
#pragma once

#include <functional>
#include <string>
#include <vector>

#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace mop::bench {

// Ceilings measured on the H200 machine; HBM is the spec value (no measured one yet).
constexpr double kGemmTflops = 790;      // cuBLAS bf16 8192³ on random data
constexpr double kAttnFwdTflops = 650;   // cuDNN flash attention fwd, hd 128 (610–685)
constexpr double kAttnBwdTflops = 490;   // cuDNN flash attention bwd, hd 128 (455–530)
constexpr double kHbmGBps = 4800;        // H200 HBM3e spec

struct Case {
  std::string name;
  std::function<void()> run;
  bool gpu = true;
};
std::vector<Case>& registry();
struct Register {
  Register(const char* name, std::function<void()> fn, bool gpu) {
    registry().push_back({name, std::move(fn), gpu});
  }
};

// Best of `repeats` wall-clock seconds of fn, after one warm-up call (CPU cases).
double best_seconds(const std::function<void()>& fn, int repeats = 5);

#ifdef MOP_HAVE_CUDA
// Median milliseconds of `iters` launches of fn on `stream` (after `warmup` untimed ones), each
// preceded by an L2 flush.
double time_ms(const std::function<void()>& fn, cudaStream_t stream, int iters = 20, int warmup = 3);

// One result line. flops/bytes ≤ 0 are left out; ceiling in the same unit as the rate.
void report(const std::string& name, bool valid, double ms, double flops, double bytes,
            double ceiling_tflops_or_gbps, const std::string& note = "");
#endif  // MOP_HAVE_CUDA

}  // namespace mop::bench

#define MOP_BENCH_CAT2(a, b) a##b
#define MOP_BENCH_CAT(a, b) MOP_BENCH_CAT2(a, b)
#define MOP_BENCH_CASE(name, gpu)                                                          \
  static void MOP_BENCH_CAT(mop_bench_fn_, __LINE__)();                                    \
  static ::mop::bench::Register MOP_BENCH_CAT(mop_bench_reg_, __LINE__)(                   \
      name, MOP_BENCH_CAT(mop_bench_fn_, __LINE__), gpu);                                  \
  static void MOP_BENCH_CAT(mop_bench_fn_, __LINE__)()
#define MOP_BENCH(name) MOP_BENCH_CASE(name, true)
#define MOP_BENCH_CPU(name) MOP_BENCH_CASE(name, false)
