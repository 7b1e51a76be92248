// Cross-entropy kernels of the fused LM head: per-row log-sum-exp + loss, and bf16 dlogits.
// One block per row of the fp32 logits chunk; float4 loads when the vocabulary is a multiple of 4
// (V = 151936 is), scalar loads otherwise.
#include <cstring>

#include "runtime/cuda_check.h"
#include "kernels/lmhead.cuh"

namespace mop::kernels {
namespace {

constexpr int kWarp = 32;
constexpr int kFwdThreads = 512;  // a 151936-wide row is 74 float4 per thread
constexpr int kBwdThreads = 256;

// A partial log-sum-exp: running maximum m and s = Σ exp(z − m) over the elements seen so far
// (the "online normaliser" of Milakov & Gimelshein). It reads the row once; a max pass then a sum
// pass would read it twice, and a 600 KB row of ~260 resident blocks does not stay in L2 between
// the passes, so the two-pass form costs a second full read of the [C,V] chunk.
struct MaxSum {
  float m;
  float s;
};

// Commutative (fmaxf and one fp32 add of two products), so every lane of an xor-shuffle
// reduction ends with bitwise the same value.
__device__ __forceinline__ MaxSum combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};  // both empty: exp(−inf − (−inf)) would be NaN
  return {m, a.s * expf(a.m - m) + b.s * expf(b.m - m)};
}

// An empty partial (m = −inf, s = 0) rescales to 0 · exp(−inf) = 0 on its first element. A NaN
// logit never raises m (comparisons with NaN are false) but makes s NaN, so it reaches the loss.
__device__ __forceinline__ void add1(MaxSum& acc, float z) {
  if (z > acc.m) {
    acc.s *= expf(acc.m - z);
    acc.m = z;
  }
  acc.s += expf(z - acc.m);
}

__device__ __forceinline__ void add4(MaxSum& acc, float4 v) {
  const float mx = fmaxf(fmaxf(v.x, v.y), fmaxf(v.z, v.w));
  if (mx > acc.m) {
    acc.s *= expf(acc.m - mx);
    acc.m = mx;
  }
  acc.s += (expf(v.x - acc.m) + expf(v.y - acc.m)) + (expf(v.z - acc.m) + expf(v.w - acc.m));
}

__device__ __forceinline__ MaxSum warp_reduce(MaxSum v) {
  for (int offset = kWarp / 2; offset > 0; offset >>= 1) {
    const MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, offset),
                       __shfl_xor_sync(0xffffffffu, v.s, offset)};
    v = combine(v, other);
  }
  return v;
}

// The block's total, valid in warp 0.
template <int kThreads>
__device__ MaxSum block_reduce(MaxSum v) {
  static_assert(kThreads % kWarp == 0 && kThreads / kWarp <= kWarp);
  __shared__ MaxSum partial[kThreads / kWarp];
  const int lane = int(threadIdx.x) % kWarp, warp = int(threadIdx.x) / kWarp;
  v = warp_reduce(v);
  if (lane == 0) partial[warp] = v;
  __syncthreads();
  if (warp == 0) {
    v = lane < kThreads / kWarp ? partial[lane] : MaxSum{-INFINITY, 0.f};
    v = warp_reduce(v);
  }
  return v;
}

// Block = row. The logits are read once (streaming loads: the next chunk's GEMM overwrites them).
template <bool kVec>
__global__ void __launch_bounds__(kFwdThreads)
    cross_entropy_fwd_kernel(float* loss, float* lse, const float* logits, const int32_t* targets,
                             int64_t vocab) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * vocab;
  MaxSum acc{-INFINITY, 0.f};
  if constexpr (kVec) {
    const float4* z4 = reinterpret_cast<const float4*>(z);
    for (int64_t i = threadIdx.x; i < vocab / 4; i += kFwdThreads) add4(acc, __ldcs(z4 + i));
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kFwdThreads) add1(acc, z[i]);
  }
  acc = block_reduce<kFwdThreads>(acc);
  if (threadIdx.x == 0) {
    const float row_lse = acc.m + logf(acc.s);
    const int32_t target = targets[row];
    lse[row] = row_lse;
    loss[row] = target < 0       ? 0.f
                : target < vocab ? row_lse - z[target]
                                 : __int_as_float(0x7fc00000);  // NaN: target out of range
  }
}

// Same expression and order as the CPU reference: (p − 1 or p) · grad_scale.
__device__ __forceinline__ float dlogit(float z, int64_t v, int32_t target, float row_lse,
                                        float grad_scale) {
  const float p = expf(z - row_lse);
  return (v == target ? p - 1.f : p) * grad_scale;
}

__device__ __forceinline__ uint32_t bits(__nv_bfloat162 h) {
  uint32_t u;
  memcpy(&u, &h, sizeof(u));
  return u;
}

template <bool kVec>
__global__ void __launch_bounds__(kBwdThreads)
    cross_entropy_bwd_kernel(__nv_bfloat16* dlogits, const float* logits, const float* lse,
                             const int32_t* targets, float grad_scale, int64_t vocab) {
  const int64_t row = blockIdx.x;
  const float* z = logits + row * vocab;
  __nv_bfloat16* d = dlogits + row * vocab;
  const int32_t target = targets[row];
  const float row_lse = lse[row];
  if constexpr (kVec) {
    // 4 logits (16 bytes) in, 4 bf16 (8 bytes, one uint2) out; element v0 in the low half.
    const float4* z4 = reinterpret_cast<const float4*>(z);
    uint2* d4 = reinterpret_cast<uint2*>(d);
    for (int64_t i = threadIdx.x; i < vocab / 4; i += kBwdThreads) {
      uint2 out = make_uint2(0u, 0u);
      if (target >= 0) {
        const float4 v = __ldcs(z4 + i);
        const int64_t v0 = 4 * i;
        out.x = bits(__floats2bfloat162_rn(dlogit(v.x, v0, target, row_lse, grad_scale),
                                           dlogit(v.y, v0 + 1, target, row_lse, grad_scale)));
        out.y = bits(__floats2bfloat162_rn(dlogit(v.z, v0 + 2, target, row_lse, grad_scale),
                                           dlogit(v.w, v0 + 3, target, row_lse, grad_scale)));
      }
      d4[i] = out;
    }
  } else {
    for (int64_t i = threadIdx.x; i < vocab; i += kBwdThreads)
      d[i] = __float2bfloat16_rn(target < 0 ? 0.f : dlogit(z[i], i, target, row_lse, grad_scale));
  }
}

bool aligned(const void* p, uintptr_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

}  // namespace

void cross_entropy_fwd(float* loss, float* lse, const float* logits, const int32_t* targets,
                       int64_t rows, int64_t vocab, cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && rows <= INT32_MAX && vocab >= 1, "cross_entropy_fwd: rows ", rows,
            ", vocab ", vocab);
  if (rows == 0) return;
  MOP_CHECK(loss && lse && logits && targets, "cross_entropy_fwd: null pointer");
  const unsigned grid = unsigned(rows);
  if (vocab % 4 == 0 && aligned(logits, 16))
    cross_entropy_fwd_kernel<true>
        <<<grid, kFwdThreads, 0, stream>>>(loss, lse, logits, targets, vocab);
  else
    cross_entropy_fwd_kernel<false>
        <<<grid, kFwdThreads, 0, stream>>>(loss, lse, logits, targets, vocab);
  MOP_CUDA_CHECK_LAUNCH();
}

void cross_entropy_bwd(__nv_bfloat16* dlogits, const float* logits, const float* lse,
                       const int32_t* targets, float grad_scale, int64_t rows, int64_t vocab,
                       cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && rows <= INT32_MAX && vocab >= 1, "cross_entropy_bwd: rows ", rows,
            ", vocab ", vocab);
  if (rows == 0) return;
  MOP_CHECK(dlogits && logits && lse && targets, "cross_entropy_bwd: null pointer");
  const unsigned grid = unsigned(rows);
  if (vocab % 4 == 0 && aligned(logits, 16) && aligned(dlogits, 8))
    cross_entropy_bwd_kernel<true>
        <<<grid, kBwdThreads, 0, stream>>>(dlogits, logits, lse, targets, grad_scale, vocab);
  else
    cross_entropy_bwd_kernel<false>
        <<<grid, kBwdThreads, 0, stream>>>(dlogits, logits, lse, targets, grad_scale, vocab);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
