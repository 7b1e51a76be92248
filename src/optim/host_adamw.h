// Host AdamW: the reference AdamW step (ops/cpu/adamw.cpp) on fp32 master weights, m and v in
// host (pinned) memory, with bf16 or fp32 gradients, optionally writing the updated weights
// rounded to bf16 for the GPU. Kernels for AVX-512, AVX2 and plain scalar code, picked at run time
// from the CPU's features, each bitwise identical to the reference for every input; a ThreadPool
// spreads a range over pinned workers, synchronously or with a ticket to wait on later.
#pragma once

#include <cstdint>
#include <string_view>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "ops/ops.h"

namespace mop {

enum class SimdIsa : uint8_t { Scalar, Avx2, Avx512 };

bool simd_isa_supported(SimdIsa isa);  // by this CPU and OS (and compiled in: x86-64 only)
SimdIsa best_simd_isa();               // the widest supported; detected once
std::string_view simd_isa_name(SimdIsa isa);

// One contiguous slice of optimizer state: element i of every array belongs to one parameter.
struct HostAdamWRange {
  float* master = nullptr;     // fp32 master weights, updated in place
  float* m = nullptr;          // exp_avg, updated in place
  float* v = nullptr;          // exp_avg_sq, updated in place
  const void* grad = nullptr;  // grad_dtype: F32 or BF16; read only
  DType grad_dtype = DType::BF16;
  bf16* weights = nullptr;  // optional: float_to_bf16(updated master); nullptr writes nothing
  float* weights_f32 = nullptr;  // optional instead: the updated master itself
  // false: master, m and v are only read, and only the weights are written (the weights-first
  // pass of an overlapped step; a second pass with write_state then writes the same state bits).
  bool write_state = true;
  int64_t n = 0;

  HostAdamWRange slice(int64_t begin, int64_t end) const;
};

// A range over whole tensors, checked as the reference checks them: on the CPU, f32 state, the
// same numel everywhere; grad F32 or BF16; `weights` may be an empty Tensor() (no output), BF16 or
// F32.
HostAdamWRange host_adamw_range(Tensor master, Tensor m, Tensor v, const Tensor& grad,
                                Tensor weights = Tensor());

// Updates the range on the calling thread with one ISA's kernel (it must be supported).
void host_adamw_update(const HostAdamWRange& range, const AdamWArgs& args,
                       SimdIsa isa = best_simd_isa());

// Elements per pool chunk: 128 KiB of each fp32 array (≈ 900 KiB of traffic with the gradient and
// the bf16 output), big enough that per-chunk overhead vanishes and the hardware prefetchers run
// long streams, small enough that a 16-thread pool balances a few-MB tensor. A multiple of 16, so
// only a range's last chunk has a scalar tail.
constexpr int64_t kHostAdamWChunk = int64_t(1) << 15;

// Queues the update of `range` on `pool` and returns at once; the arrays must stay valid and
// untouched until pool.wait(ticket). Arguments are checked here, on the calling thread.
ThreadPool::Ticket host_adamw_submit(ThreadPool& pool, const HostAdamWRange& range,
                                     const AdamWArgs& args, SimdIsa isa = best_simd_isa());
inline void host_adamw_run(ThreadPool& pool, const HostAdamWRange& range, const AdamWArgs& args,
                           SimdIsa isa = best_simd_isa()) {
  pool.wait(host_adamw_submit(pool, range, args, isa));
}

}  // namespace mop
