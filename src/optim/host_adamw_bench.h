// Optimizer state for the host AdamW benchmarks (mop_tests "[host_adamw]", mop_bench host,
// mop calibrate): n parameters' fp32 master, m, v, bf16 gradient and bf16 weights in one kind of
// host memory, and the range over them; fill() writes typical magnitudes from a cheap hash
// (philox per element would dominate the setup time) on a pool, so each page lands near the
// thread that updates it; validate() checks the engine against the reference on the first
// elements before timing.
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include "ops/ops.h"
#include "optim/host_adamw.h"
#include "runtime/memory.h"

namespace mop {

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

  // One step of the first elements, from the current state, as the overlapped step runs it (a
  // weights pass, then a state pass) against the reference adamw_step: "" when every bit agrees
  // (weights, state untouched by the weights pass, then master, m and v), else what differs.
  std::string validate(ThreadPool& pool, const AdamWArgs& args, SimdIsa isa) {
    const int64_t n = std::min(3 * kHostAdamWChunk + 11, r.n);
    std::vector<float> p(r.master, r.master + n), m0(r.m, r.m + n), v0(r.v, r.v + n);
    std::vector<bf16> g(static_cast<const bf16*>(r.grad), static_cast<const bf16*>(r.grad) + n);
    const std::vector<float> before = p;
    static const std::unique_ptr<Ops> reference = make_cpu_ops();
    reference->adamw_step(Tensor(p.data(), DType::F32, {n}), Tensor(m0.data(), DType::F32, {n}),
                          Tensor(v0.data(), DType::F32, {n}), Tensor(g.data(), DType::BF16, {n}),
                          args);
    HostAdamWRange weights_pass = r.slice(0, n);
    weights_pass.write_state = false;
    host_adamw_run(pool, weights_pass, args, isa);
    auto same = [n](const float* a, const float* b) { return std::memcmp(a, b, size_t(n) * 4) == 0; };
    if (!same(r.master, before.data())) return "the weights pass wrote the master weights";
    for (int64_t i = 0; i < n; ++i)
      if (r.weights[i].bits != float_to_bf16(p[size_t(i)]).bits)
        return "weights differ from the reference at " + std::to_string(i);
    HostAdamWRange state_pass = r.slice(0, n);
    state_pass.weights = nullptr;
    host_adamw_run(pool, state_pass, args, isa);
    if (!same(r.master, p.data()) || !same(r.m, m0.data()) || !same(r.v, v0.data()))
      return "master, m or v differ from the reference";
    return "";
  }
};

}  // namespace mop
