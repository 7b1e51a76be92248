// Overlap benchmark (mop_bench overlap): does the device AdamW on a stream of its own hide beside
// the grouped expert GEMMs, as `optim.overlap` runs the last step's update beside the next forward?
// Times AdamW over 200M parameters alone, 8 gate_up forwards at 1024 rows per expert alone, and
// both started together on two streams; "hidden" is the part of the shorter one the overlap saved.
#include "bench.h"

#ifdef MOP_HAVE_CUDA

#include <algorithm>
#include <cstdio>
#include <functional>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "ops/cuda_ops.h"
#include "runtime/cuda_check.h"

namespace mop::bench {
namespace {

// A zero-filled device tensor.
test::DeviceTensor zeros(DType dtype, std::initializer_list<int64_t> dims) {
  test::DeviceTensor d(dtype, dims);
  MOP_CUDA_CHECK(cudaMemset(d.t.data, 0, d.t.bytes()));
  return d;
}

// Wall milliseconds from a common start until both a() on stream sa and b() on stream sb are done
// (either may be empty).
double both_ms(const std::function<void()>& a, cudaStream_t sa, const std::function<void()>& b,
               cudaStream_t sb) {
  cudaEvent_t start, end_b, stop;
  MOP_CUDA_CHECK(cudaEventCreate(&start));
  MOP_CUDA_CHECK(cudaEventCreate(&end_b));
  MOP_CUDA_CHECK(cudaEventCreate(&stop));
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
  MOP_CUDA_CHECK(cudaEventRecord(start, sa));
  MOP_CUDA_CHECK(cudaStreamWaitEvent(sb, start));
  if (b) b();
  MOP_CUDA_CHECK(cudaEventRecord(end_b, sb));
  if (a) a();
  MOP_CUDA_CHECK(cudaStreamWaitEvent(sa, end_b));
  MOP_CUDA_CHECK(cudaEventRecord(stop, sa));
  MOP_CUDA_CHECK(cudaEventSynchronize(stop));
  float ms = 0;
  MOP_CUDA_CHECK(cudaEventElapsedTime(&ms, start, stop));
  cudaEventDestroy(start);
  cudaEventDestroy(end_b);
  cudaEventDestroy(stop);
  return ms;
}

MOP_BENCH("overlap adamw beside grouped gemm") {
  CudaOps compute, update;  // each on its own stream
  const int64_t n = 200'000'000;
  const test::DeviceTensor p = zeros(DType::F32, {n}), m = zeros(DType::F32, {n}),
                           v = zeros(DType::F32, {n}), g = zeros(DType::F32, {n}),
                           wb = zeros(DType::BF16, {n});
  AdamWArgs args;
  args.lr = 3e-4f;
  args.weight_decay = 0.1f;
  args.bias_correction1 = 1.0f - 0.9f;
  args.bias_correction2 = 1.0f - 0.95f;
  const int64_t rows = 1024, e_count = 128, hn = 1536, hk = 2048, reps = 8;
  const test::DeviceTensor x = zeros(DType::BF16, {e_count * rows, hk}),
                           w = zeros(DType::BF16, {e_count, hn, hk}),
                           y = zeros(DType::BF16, {e_count * rows, hn});
  {  // random bf16 operands (zeros would draw less power than training's data): one random
     // block of 2^24 elements repeated
    std::vector<uint16_t> block(size_t(1) << 24);
    uint64_t z = 7;
    for (auto& b : block) {
      z = z * 6364136223846793005ull + 1442695040888963407ull;
      b = uint16_t(0x3c00 | ((z >> 40) & 0x807f));  // ±[2^-7, 2^-6) with a random mantissa
    }
    for (const Tensor* t : {&x.t, &w.t})
      for (size_t off = 0; off < t->bytes(); off += block.size() * 2)
        MOP_CUDA_CHECK(cudaMemcpy(static_cast<char*>(t->data) + off, block.data(),
                                  std::min(block.size() * 2, t->bytes() - off),
                                  cudaMemcpyHostToDevice));
  }
  std::vector<int32_t> offs(size_t(e_count + 1));
  for (int64_t e = 0; e <= e_count; ++e) offs[size_t(e)] = int32_t(e * rows);
  const Tensor offsets(offs.data(), DType::I32, {e_count + 1}, Device::CPU);
  // param, m, v read and written, f32 grad read, bf16 weights written
  const double bytes = 30.0 * double(n);
  const double flops = 2.0 * double(e_count * rows * hn * hk) * double(reps);
  const auto adamw = [&] { update.adamw_step_cast(p.t, m.t, v.t, g.t, args, wb.t); };
  const auto gemms = [&] {
    for (int i = 0; i < reps; ++i) compute.grouped_gemm_fwd(y, x, w, offsets);
  };
  const cudaStream_t sc = compute.cuda_stream(), su = update.cuda_stream();
  // Valid: one update from the same state gives the same bytes alone and beside the GEMMs.
  const auto updated_bytes = [&](bool beside) {
    compute.fill(p.t, 0.5);
    compute.fill(m.t, 1e-3);
    compute.fill(v.t, 1e-6);
    compute.fill(g.t, 1e-3);
    compute.synchronize();
    both_ms(beside ? std::function<void()>(gemms) : std::function<void()>(), sc, adamw, su);
    std::vector<uint8_t> h(p.t.bytes());
    MOP_CUDA_CHECK(cudaMemcpy(h.data(), p.t.data, h.size(), cudaMemcpyDeviceToHost));
    return h;
  };
  const bool valid = updated_bytes(false) == updated_bytes(true);
  for (int i = 0; i < 3; ++i) both_ms(gemms, sc, adamw, su);  // warm-up
  std::vector<double> ta, tg, tb;
  for (int i = 0; i < 5; ++i) {
    ta.push_back(both_ms(nullptr, sc, adamw, su));
    tg.push_back(both_ms(gemms, sc, nullptr, su));
    tb.push_back(both_ms(gemms, sc, adamw, su));
  }
  const auto median = [](std::vector<double> t) {
    std::sort(t.begin(), t.end());
    return t[t.size() / 2];
  };
  const double a = median(ta), gm = median(tg), b = median(tb);
  report("overlap: adamw_step_cast alone [200M params]", valid, a, 0, bytes, kHbmGBps);
  report("overlap: grouped fwd x8 alone [gate_up E128x1024]", valid, gm, flops, 0, kGemmTflops);
  char note[160];
  std::snprintf(note, sizeof note, "serial %.3f ms; hidden %.0f%% of the adamw", a + gm,
                100.0 * (a + gm - b) / std::min(a, gm));
  report("overlap: both, two streams", valid, b, 0, 0, 0, note);
}

}  // namespace
}  // namespace mop::bench

#endif  // MOP_HAVE_CUDA
