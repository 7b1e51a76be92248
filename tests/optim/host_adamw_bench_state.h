// Optimizer state for the host AdamW benchmarks (mop_tests "[host_adamw]", mop_bench host): n
// parameters' fp32 master, m, v, bf16 gradient and bf16 weights in one kind of host memory, and the
// range over them; fill() writes typical magnitudes from a cheap hash (philox per element would
// dominate the setup time) on a pool, so each page lands near the thread that updates it.
#pragma once

#include <cstdint>

#include "core/memory.h"
#include "optim/host_adamw.h"

namespace mop::test {

struct HostAdamWBenchState {
  Buffer master, m, v, grad, weights;
  HostAdamWRange r;

  HostAdamWBenchState(int64_t n, MemKind kind)
      : master(kind, size_t(n) * 4), m(kind, size_t(n) * 4), v(kind, size_t(n) * 4),
        grad(kind, size_t(n) * 2), weights(kind, size_t(n) * 2) {
    r.master = static_cast<float*>(master.data());
    r.m = static_cast<float*>(m.data());
    r.v = static_cast<float*>(v.data());
    r.grad = grad.data();
    r.grad_dtype = DType::BF16;
    r.weights = static_cast<bf16*>(weights.data());
    r.n = n;
  }

  void fill(ThreadPool& pool) {
    pool.run(r.n, kHostAdamWChunk, [this](int64_t b, int64_t e) {
      for (int64_t i = b; i < e; ++i) {
        const uint64_t h = uint64_t(i) * 0x9e3779b97f4a7c15ull;
        const float u = float(h >> 40) / 16777216.0f - 0.5f;  // [-0.5, 0.5)
        r.master[i] = 0.1f * u;
        r.m[i] = 1e-3f * u;
        r.v[i] = 1e-6f * u * u;
        static_cast<bf16*>(grad.data())[i] = float_to_bf16(2e-3f * u);
      }
    });
  }
};

}  // namespace mop::test
