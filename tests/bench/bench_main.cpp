// mop_bench: runs every registered benchmark (or those whose name contains argv[1]): CPU cases
// always, GPU cases where a CUDA device is. Exit 77 when a selected case needs a GPU this machine
// lacks and nothing else ran.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "bench.h"

#ifdef MOP_HAVE_CUDA
#include "runtime/cuda_check.h"
#include "runtime/memory.h"
#endif

namespace mop::bench {

std::vector<Case>& registry() {
  static std::vector<Case> cases;
  return cases;
}

double best_seconds(const std::function<void()>& fn, int repeats) {
  fn();
  double best = 1e30;
  for (int i = 0; i < repeats; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    fn();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

#ifdef MOP_HAVE_CUDA
double time_ms(const std::function<void()>& fn, cudaStream_t stream, int iters, int warmup) {
  // A buffer larger than the H200's 60 MB L2, rewritten before each timed launch.
  static Buffer flush(MemKind::Device, size_t(256) << 20);
  cudaEvent_t start, stop;
  MOP_CUDA_CHECK(cudaEventCreate(&start));
  MOP_CUDA_CHECK(cudaEventCreate(&stop));
  for (int i = 0; i < warmup; ++i) fn();
  std::vector<float> times;
  for (int i = 0; i < iters; ++i) {
    MOP_CUDA_CHECK(cudaMemsetAsync(flush.data(), i & 0xff, flush.bytes(), stream));
    MOP_CUDA_CHECK(cudaEventRecord(start, stream));
    fn();
    MOP_CUDA_CHECK(cudaEventRecord(stop, stream));
    MOP_CUDA_CHECK(cudaEventSynchronize(stop));
    float ms = 0;
    MOP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
    times.push_back(ms);
  }
  cudaEventDestroy(start);
  cudaEventDestroy(stop);
  std::sort(times.begin(), times.end());
  return times[times.size() / 2];
}

void report(const std::string& name, bool valid, double ms, double flops, double bytes,
            double ceiling, const std::string& note) {
  std::printf("%-58s %s %9.3f ms", name.c_str(), valid ? "valid  " : "INVALID", ms);
  if (flops > 0) {
    double tf = flops / ms / 1e9;
    std::printf(" %8.1f TFLOP/s %5.1f%%", tf, 100 * tf / ceiling);
  } else if (bytes > 0) {
    double gb = bytes / ms / 1e6;
    std::printf(" %8.1f GB/s    %5.1f%%", gb, 100 * gb / ceiling);
  }
  if (!note.empty()) std::printf("  %s", note.c_str());
  std::printf("\n");
  std::fflush(stdout);
}

#endif  // MOP_HAVE_CUDA

}  // namespace mop::bench

namespace {
// Whether a CUDA device is here (a build without CUDA has none); `why` says what is missing.
bool have_gpu(std::string& why) {
#ifdef MOP_HAVE_CUDA
  int n = 0;
  const cudaError_t err = cudaGetDeviceCount(&n);
  if (err == cudaSuccess && n > 0) return true;
  why = err != cudaSuccess ? cudaGetErrorString(err) : "none found";
  return false;
#else
  why = "a build without CUDA";
  return false;
#endif
}
}  // namespace

int main(int argc, char** argv) {
  std::string why;
  const bool gpu = have_gpu(why);
  int failures = 0, ran = 0, skipped = 0;
  for (auto& c : mop::bench::registry()) {
    if (argc > 1 && !std::strstr(c.name.c_str(), argv[1])) continue;
    if (c.gpu && !gpu) {
      ++skipped;
      continue;
    }
    ++ran;
    try {
      c.run();
    } catch (const std::exception& e) {
      std::printf("%-58s FAILED: %s\n", c.name.c_str(), e.what());
      ++failures;
    }
  }
  if (skipped)
    std::printf("mop_bench: %d GPU case(s) skipped: no CUDA device here (%s)\n", skipped, why.c_str());
  if (failures) return 1;
  return ran == 0 && skipped > 0 ? 77 : 0;
}
