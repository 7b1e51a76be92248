// Elementwise and reduction kernels: fill, dtype conversion, add, sum (deterministic two-stage
// reduction) and the exact sum of squares, on bf16/f32/f64 data with fp32 (reductions: fp64) math.
// Launchers take the destination first and the stream last, check their preconditions and the
// launch, and never allocate. Under __CUDACC__ this header also holds the device helpers the other
// .cu files share (vector loads, bf16 packing, sums).
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

#include "core/dtype.h"

namespace mop::kernels {

// Sets n elements of elem_size bytes (2, 4 or 8) to the bit pattern in the low bytes of `bits`.
void fill(void* x, uint64_t bits, size_t elem_size, int64_t n, cudaStream_t stream);

// dst[i] = src[i] converted: between f32, f64 and bf16 (to bf16: one nearest-even rounding, also
// from f64), or a plain copy when the dtypes are equal. dst and src must not overlap.
void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n,
             cudaStream_t stream);

// out = a + b over n elements of `dtype` (f32, f64 or bf16; bf16 adds in fp32 and rounds once).
// out may alias a or b.
void add(void* out, const void* a, const void* b, DType dtype, int64_t n, cudaStream_t stream);

// Blocks of the first reduction stage; `partials` holds one double per block.
constexpr int kReduceMaxBlocks = 1024;
// out[0] = Σ x over n elements of a float dtype; out is an f32 or f64 device scalar.
// Deterministic: a grid fixed by n and alignment, per-block partials in fp64, and one block that
// sums them in order.
void reduce_sum(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t n,
                double* partials, cudaStream_t stream);
// out[0..3] = the exact sum of squares of n elements of a float dtype (op_list.inc's sumsq: its
// blocks, their trees, fixed-point words and the bad flag), out an i64 [4] device array. partials
// holds 4 words per block of the first stage (kReduceMaxBlocks of them).
void sumsq_exact(int64_t* out, const void* x, DType x_dtype, int64_t n, uint64_t* partials,
                 cudaStream_t stream);

}  // namespace mop::kernels

#ifdef __CUDACC__

#include <cstring>
#include <type_traits>

namespace mop::kernels::detail {

constexpr int kWarpSize = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Blocks for a grid-stride loop over `items` work items: enough to fill the GPU several times
// over, never more than the items need.
inline unsigned grid_for(int64_t items, int threads, int64_t cap = 8192) {
  int64_t blocks = (items + threads - 1) / threads;
  if (blocks < 1) blocks = 1;
  return unsigned(blocks < cap ? blocks : cap);
}

inline bool aligned_to(const void* p, size_t bytes) {
  return reinterpret_cast<uintptr_t>(p) % bytes == 0;
}

// N elements of T as one vector: 2 to 16 bytes in one load, 32 bytes in two 16-byte loads.
// bf16 data travels as uint16_t bit patterns (trivially copyable, no conversions by accident).
template <class T, int N>
struct alignas(sizeof(T) * N < 16 ? sizeof(T) * N : 16) Packed {
  T v[N];
};

template <class T, int N>
__device__ __forceinline__ Packed<T, N> load_packed(const T* p) {
  constexpr int kBytes = int(sizeof(T)) * N;
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16 || kBytes == 32);
  Packed<T, N> r;
  if constexpr (kBytes == 32) {
    const int4 a = reinterpret_cast<const int4*>(p)[0], b = reinterpret_cast<const int4*>(p)[1];
    memcpy(reinterpret_cast<char*>(&r), &a, 16);
    memcpy(reinterpret_cast<char*>(&r) + 16, &b, 16);
  } else if constexpr (kBytes == 16) {
    const int4 a = *reinterpret_cast<const int4*>(p);
    memcpy(&r, &a, 16);
  } else if constexpr (kBytes == 8) {
    const int2 a = *reinterpret_cast<const int2*>(p);
    memcpy(&r, &a, 8);
  } else if constexpr (kBytes == 4) {
    const int a = *reinterpret_cast<const int*>(p);
    memcpy(&r, &a, 4);
  } else {
    const unsigned short a = *reinterpret_cast<const unsigned short*>(p);
    memcpy(&r, &a, 2);
  }
  return r;
}

template <class T, int N>
__device__ __forceinline__ void store_packed(T* p, const Packed<T, N>& r) {
  constexpr int kBytes = int(sizeof(T)) * N;
  static_assert(kBytes == 2 || kBytes == 4 || kBytes == 8 || kBytes == 16 || kBytes == 32);
  if constexpr (kBytes == 32) {
    int4 a, b;
    memcpy(&a, reinterpret_cast<const char*>(&r), 16);
    memcpy(&b, reinterpret_cast<const char*>(&r) + 16, 16);
    reinterpret_cast<int4*>(p)[0] = a;
    reinterpret_cast<int4*>(p)[1] = b;
  } else if constexpr (kBytes == 16) {
    int4 a;
    memcpy(&a, &r, 16);
    *reinterpret_cast<int4*>(p) = a;
  } else if constexpr (kBytes == 8) {
    int2 a;
    memcpy(&a, &r, 8);
    *reinterpret_cast<int2*>(p) = a;
  } else if constexpr (kBytes == 4) {
    int a;
    memcpy(&a, &r, 4);
    *reinterpret_cast<int*>(p) = a;
  } else {
    unsigned short a;
    memcpy(&a, &r, 2);
    *reinterpret_cast<unsigned short*>(p) = a;
  }
}

// bf16 bit patterns ↔ float. Widening is exact; narrowing rounds to nearest-even.
__device__ __forceinline__ float bf16_bits_to_float(uint16_t b) {
  return __uint_as_float(uint32_t(b) << 16);
}
__device__ __forceinline__ uint16_t float_to_bf16_bits(float f) {
  return __bfloat16_as_ushort(__float2bfloat16_rn(f));
}
__device__ __forceinline__ float bf16_to_float(__nv_bfloat16 h) {
  return bf16_bits_to_float(__bfloat16_as_ushort(h));
}
__device__ __forceinline__ __nv_bfloat16 float_to_bf16(float f) {
  return __float2bfloat16_rn(f);
}

// Eight bf16 (one 16-byte vector, element 0 in the low half of .x) ↔ eight floats.
__device__ __forceinline__ void unpack_bf16x8(const uint4& u, float f[8]) {
  const uint32_t w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    f[2 * k] = __uint_as_float(w[k] << 16);
    f[2 * k + 1] = __uint_as_float(w[k] & 0xffff0000u);
  }
}
__device__ __forceinline__ uint4 pack_bf16x8(const float f[8]) {
  uint32_t w[4];
#pragma unroll
  for (int k = 0; k < 4; ++k)
    w[k] =
        uint32_t(float_to_bf16_bits(f[2 * k])) | (uint32_t(float_to_bf16_bits(f[2 * k + 1])) << 16);
  return make_uint4(w[0], w[1], w[2], w[3]);
}
__device__ __forceinline__ uint4 load_bf16x8(const __nv_bfloat16* p) {
  return *reinterpret_cast<const uint4*>(p);
}
__device__ __forceinline__ void store_bf16x8(__nv_bfloat16* p, const uint4& v) {
  *reinterpret_cast<uint4*>(p) = v;
}

// Sum over a group of kLanes consecutive lanes (a power of two ≤ 32) by xor butterflies: every lane
// of the group gets the same result, in an order fixed by the code (deterministic). All 32 lanes of
// the warp must call it.
template <int kLanes, class T>
__device__ __forceinline__ T group_sum(T v) {
  static_assert(kLanes >= 1 && kLanes <= 32 && (kLanes & (kLanes - 1)) == 0);
#pragma unroll
  for (int off = kLanes / 2; off > 0; off /= 2) v += __shfl_xor_sync(kFullMask, v, off);
  return v;
}

// Sum over the block (blockDim.x a multiple of 32, ≤ 1024); every thread gets the result. The warp
// sums are added in warp order. `smem` holds 32 values; the leading barrier lets a caller reuse it
// in a loop.
template <class T>
__device__ __forceinline__ T block_sum(T v, T* smem) {
  v = group_sum<kWarpSize>(v);
  const int warp = int(threadIdx.x) / kWarpSize, num_warps = int(blockDim.x) / kWarpSize;
  __syncthreads();
  if (threadIdx.x % kWarpSize == 0) smem[warp] = v;
  __syncthreads();
  T total = smem[0];
  for (int w = 1; w < num_warps; ++w) total += smem[w];
  return total;
}

}  // namespace mop::kernels::detail

#endif  // __CUDACC__
