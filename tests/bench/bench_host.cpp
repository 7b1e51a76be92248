// Host-memory benchmark (mop_bench host): does PCIe traffic slow the host AdamW down? Both share
// the host's memory bandwidth: the update moves 28 bytes per parameter (fp32 master, m, v read and
// written, bf16 gradient in, bf16 weights out), a pinned copy moves its bytes once. Timed alone and
// together: the host AdamW engine over 500M parameters (all of this rank's cores), and copies of
// 1 GiB pinned buffers to and from the GPU, both directions at once; and the overlapped step's two
// passes (weights only, then state only) alone. The engine is checked against the reference first.
#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>

#include "bench.h"
#include "runtime/cuda_check.h"
#include "runtime/memory.h"
#include "optim/host_adamw.h"
#include "optim/host_adamw_bench.h"

namespace mop::bench {
namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

struct Copies {
  static constexpr size_t kBytes = size_t(1) << 30;
  Buffer up_host{MemKind::Pinned, kBytes}, down_host{MemKind::Pinned, kBytes};
  Buffer up_dev{MemKind::Device, kBytes}, down_dev{MemKind::Device, kBytes};
  cudaStream_t up = nullptr, down = nullptr;
  cudaEvent_t start = nullptr, up_done = nullptr, down_done = nullptr;
  Copies() {
    std::memset(up_host.data(), 1, kBytes);
    std::memset(down_host.data(), 2, kBytes);
    MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&up, cudaStreamNonBlocking));
    MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&down, cudaStreamNonBlocking));
    for (cudaEvent_t* e : {&start, &up_done, &down_done}) MOP_CUDA_CHECK(cudaEventCreate(e));
  }
  ~Copies() {
    for (cudaEvent_t e : {start, up_done, down_done}) cudaEventDestroy(e);
    cudaStreamDestroy(up);
    cudaStreamDestroy(down);
  }
  // Queues `reps` copies each way and returns at once.
  void queue(int reps) {
    MOP_CUDA_CHECK(cudaEventRecord(start, up));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(down, start, 0));
    for (int i = 0; i < reps; ++i) {
      MOP_CUDA_CHECK(cudaMemcpyAsync(up_dev.data(), up_host.data(), kBytes, cudaMemcpyHostToDevice, up));
      MOP_CUDA_CHECK(cudaMemcpyAsync(down_host.data(), down_dev.data(), kBytes, cudaMemcpyDeviceToHost, down));
    }
    MOP_CUDA_CHECK(cudaEventRecord(up_done, up));
    MOP_CUDA_CHECK(cudaEventRecord(down_done, down));
  }
  // After queue(reps): waits, prints GB/s each way.
  void finish(int reps, const char* what) {
    MOP_CUDA_CHECK(cudaEventSynchronize(up_done));
    MOP_CUDA_CHECK(cudaEventSynchronize(down_done));
    float up_ms = 0, down_ms = 0;
    MOP_CUDA_CHECK(cudaEventElapsedTime(&up_ms, start, up_done));
    MOP_CUDA_CHECK(cudaEventElapsedTime(&down_ms, start, down_done));
    const double gb = double(kBytes) * reps * 1e-9;
    std::printf("%-44s host→GPU %6.1f GB/s (%7.1f ms), GPU→host %6.1f GB/s (%7.1f ms)\n", what,
                gb / up_ms * 1e3, up_ms, gb / down_ms * 1e3, down_ms);
    std::fflush(stdout);
  }
};

MOP_BENCH("host: AdamW and PCIe copies, alone and together") {
  constexpr int64_t kParams = 500'000'000;
  constexpr double kBytesPerParam = 28;
  HostAdamWBenchState state(kParams, MemKind::Pinned);
  const HostAdamWRange& r = state.r;
  AdamWArgs args;
  args.lr = 1e-4f;
  args.weight_decay = 0.1f;
  args.grad_scale = 0.5f;
  args.bias_correction1 = 0.1f;
  args.bias_correction2 = 0.001f;
  const int cpus = int(allowed_cpus().size());
  Copies copies;
  for (int threads : {cpus, std::max(1, cpus / 2)}) {
    ThreadPool pool(threads);
    state.fill(pool);
    const std::string invalid = state.validate(pool, args, best_simd_isa());
    std::printf("host AdamW, %d threads, both passes against the reference: %s\n", threads,
                invalid.empty() ? "valid" : ("INVALID: " + invalid).c_str());
    if (!invalid.empty()) return;
    auto update = [&] {
      const double t0 = now();
      host_adamw_run(pool, r, args);
      return now() - t0;
    };
    auto report_update = [&](const char* what, double s) {
      std::printf("%-44s %2d threads: %7.1f ms, %5.2f G params/s, %6.1f GB/s\n", what, threads,
                  s * 1e3, kParams / s * 1e-9, kParams * kBytesPerParam / s * 1e-9);
      std::fflush(stdout);
    };
    double alone = 1e30;
    for (int k = 0; k < 3; ++k) alone = std::min(alone, update());
    report_update("host AdamW alone", alone);
    // The overlapped step's two passes: weights only (16 bytes per parameter), then state only
    // (26 bytes: no weights out).
    for (bool state : {false, true}) {
      HostAdamWRange pass = r;
      pass.write_state = state;
      if (state) pass.weights = nullptr;
      double best = 1e30;
      for (int k = 0; k < 3; ++k) {
        const double t0 = now();
        host_adamw_run(pool, pass, args);
        best = std::min(best, now() - t0);
      }
      std::printf("%-44s %2d threads: %7.1f ms, %5.2f G params/s, %6.1f GB/s\n",
                  state ? "host AdamW state pass (no weights)" : "host AdamW weights pass (state read)",
                  threads, best * 1e3, kParams / best * 1e-9, kParams * (state ? 26 : 16) / best * 1e-9);
    }
    const int reps = 8;
    copies.queue(reps);
    copies.finish(reps, "copies alone (both ways at once)");
    for (int k = 0; k < 2; ++k) {
      copies.queue(reps);
      const double s = update();
      report_update("host AdamW during copies", s);
      copies.finish(reps, "copies during host AdamW");
    }
  }
}

}  // namespace
}  // namespace mop::bench

#endif  // MOP_HAVE_CUDA
