// Elementwise kernels (fill, convert, add, SwiGLU), the two-stage sum and the exact sum of squares.
// Memory-bound: each thread moves 16-byte vectors where the pointers allow, with a scalar loop for
// the tail and for misaligned views; SwiGLU runs one warp per row so no index is divided.
#include <algorithm>

#include "core/exact_sum.h"
#include "kernels/elementwise.cuh"
#include "runtime/cuda_check.h"

namespace mop::kernels {
namespace {

using namespace detail;

constexpr int kThreads = 256;

// bf16 is carried as its uint16_t bit pattern.
using Bf16Bits = uint16_t;

// Calls f(T{}) with the storage type of a float dtype.
template <class F>
void dispatch_float_storage(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      f(float{});
      return;
    case DType::F64:
      f(double{});
      return;
    case DType::BF16:
      f(Bf16Bits{});
      return;
    default:
      MOP_CHECK(false, "not a float dtype: ", dtype_name(dtype));
  }
}

template <class T>
__device__ __forceinline__ double to_double(T x) {
  if constexpr (std::is_same_v<T, Bf16Bits>)
    return double(bf16_bits_to_float(x));
  else
    return double(x);
}

// One element converted from S to D (float↔double round to nearest; to bf16 rounds once, to
// nearest-even: cvt.rn.bf16.f64 on sm_90 for doubles, so no double rounding through float).
template <class D, class S>
__device__ __forceinline__ D convert_elem(S x) {
  if constexpr (std::is_same_v<S, D>) {
    return x;
  } else if constexpr (std::is_same_v<D, Bf16Bits>) {
    if constexpr (std::is_same_v<S, double>)
      return __bfloat16_as_ushort(__double2bfloat16(x));
    else
      return float_to_bf16_bits(x);
  } else if constexpr (std::is_same_v<S, Bf16Bits>) {
    return D(bf16_bits_to_float(x));
  } else {
    return D(x);
  }
}

template <class T>
__device__ __forceinline__ T add_elem(T a, T b) {
  if constexpr (std::is_same_v<T, Bf16Bits>)
    return float_to_bf16_bits(bf16_bits_to_float(a) + bf16_bits_to_float(b));
  else
    return a + b;
}

// ---- kernels: vector part [0, num_vec) then scalar tail [num_vec·N, n) --------------------------

template <class T>
__global__ void fill_kernel(T* x, T value, int64_t n, int64_t num_vec) {
  constexpr int N = 16 / sizeof(T);
  Packed<T, N> pv;
#pragma unroll
  for (int k = 0; k < N; ++k) pv.v[k] = value;
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < num_vec; i += stride) store_packed(x + i * N, pv);
  for (int64_t i = num_vec * N + tid; i < n; i += stride) x[i] = value;
}

template <class D, class S>
__global__ void convert_kernel(D* __restrict__ dst, const S* __restrict__ src, int64_t n,
                               int64_t num_vec) {
  constexpr int N = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < num_vec; i += stride) {
    const Packed<S, N> a = load_packed<S, N>(src + i * N);
    Packed<D, N> b;
#pragma unroll
    for (int k = 0; k < N; ++k) b.v[k] = convert_elem<D>(a.v[k]);
    store_packed(dst + i * N, b);
  }
  for (int64_t i = num_vec * N + tid; i < n; i += stride) dst[i] = convert_elem<D>(src[i]);
}

// No __restrict__: out may alias a or b (each element is read before it is written, by one thread).
template <class T>
__global__ void add_kernel(T* out, const T* a, const T* b, int64_t n, int64_t num_vec) {
  constexpr int N = 16 / sizeof(T);
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < num_vec; i += stride) {
    const Packed<T, N> pa = load_packed<T, N>(a + i * N), pb = load_packed<T, N>(b + i * N);
    Packed<T, N> po;
#pragma unroll
    for (int k = 0; k < N; ++k) po.v[k] = add_elem(pa.v[k], pb.v[k]);
    store_packed(out + i * N, po);
  }
  for (int64_t i = num_vec * N + tid; i < n; i += stride) out[i] = add_elem(a[i], b[i]);
}

// Sum of one vector, returned in fp64. f32 and f64 terms are added in fp64. bf16 terms are paired
// in fp32 first (the pair sum rounds once, 2^-24 relative), which halves the fp64 conversions, the
// scarce unit at bf16 bandwidth.
template <class T, int N>
__device__ __forceinline__ double vector_sum(const Packed<T, N>& p) {
  double s = 0;
  if constexpr (std::is_same_v<T, Bf16Bits>) {
#pragma unroll
    for (int k = 0; k < N; k += 2)
      s += double(bf16_bits_to_float(p.v[k]) + bf16_bits_to_float(p.v[k + 1]));
  } else {
#pragma unroll
    for (int k = 0; k < N; ++k) s += double(p.v[k]);
  }
  return s;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    reduce_stage1_kernel(double* __restrict__ partials, const T* __restrict__ x, int64_t n,
                         int64_t num_vec) {
  constexpr int N = 16 / sizeof(T);
  __shared__ double smem[kWarpSize];
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  double acc = 0;
  for (int64_t i = tid; i < num_vec; i += stride) acc += vector_sum(load_packed<T, N>(x + i * N));
  for (int64_t i = num_vec * N + tid; i < n; i += stride) acc += to_double(x[i]);
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

template <class Out>
__global__ void __launch_bounds__(kReduceMaxBlocks)
    reduce_stage2_kernel(Out* __restrict__ out, const double* __restrict__ partials,
                         int num_partials) {
  __shared__ double smem[kWarpSize];
  double acc = 0;
  for (int i = int(threadIdx.x); i < num_partials; i += int(blockDim.x)) acc += partials[i];
  acc = block_sum(acc, smem);
  if (threadIdx.x == 0) *out = Out(acc);
}

// The exact sum of squares (op_list.inc's sumsq): a warp takes two blocks of kSumsqBlock elements
// at a time, lanes 0-15 the first and 16-31 the second, each lane one group of 4 elements; the
// group sums meet in the op's tree by shuffles within each half (lane 0 and 16 end with their
// block's sum), which lanes 0 and 16 add to their fixed-point sums. Integer sums add up in any
// order, so the grid is free. Explicit _rn intrinsics: no fused multiply-add may change a square.
template <class T>
__device__ __forceinline__ double square_rn(T v) {
  const double d = to_double(v);
  return __dmul_rn(d, d);
}

template <class T>
__device__ __forceinline__ double group_sumsq(const T* x, int64_t first, int64_t n, bool vec) {
  double sq[4];
  if (vec && first + 4 <= n) {
    const Packed<T, 4> p = load_packed<T, 4>(x + first);
#pragma unroll
    for (int k = 0; k < 4; ++k) sq[k] = square_rn(p.v[k]);
  } else {
#pragma unroll
    for (int k = 0; k < 4; ++k) sq[k] = first + k < n ? square_rn(x[first + k]) : 0.0;
  }
  return __dadd_rn(__dadd_rn(sq[0], sq[1]), __dadd_rn(sq[2], sq[3]));
}

__device__ __forceinline__ void shuffle_add(ExactSum& s, int offset) {
  ExactSum o;
#pragma unroll
  for (int i = 0; i < 3; ++i) o.words[i] = __shfl_down_sync(kFullMask, s.words[i], offset);
  o.bad = __shfl_down_sync(kFullMask, s.bad, offset);
  s.add(o);
}

// The thread block's sums into partials[4·blockIdx.x ...] (words, bad). smem: [warps][4].
__device__ __forceinline__ void write_block_exact(uint64_t* partials, ExactSum s,
                                                  uint64_t (*smem)[4]) {
#pragma unroll
  for (int offset = kWarpSize / 2; offset >= 1; offset /= 2) shuffle_add(s, offset);
  const int warp = int(threadIdx.x) / kWarpSize, num_warps = int(blockDim.x) / kWarpSize;
  if (threadIdx.x % kWarpSize == 0) {
    for (int i = 0; i < 3; ++i) smem[warp][i] = s.words[i];
    smem[warp][3] = s.bad;
  }
  __syncthreads();
  if (threadIdx.x != 0) return;
  ExactSum total;
  for (int w = 0; w < num_warps; ++w) {
    total.add_words(smem[w][0], smem[w][1], smem[w][2]);
    total.bad |= smem[w][3];
  }
  uint64_t* out = partials + 4 * size_t(blockIdx.x);
  out[0] = total.words[0], out[1] = total.words[1], out[2] = total.words[2], out[3] = total.bad;
}

template <class T>
__global__ void __launch_bounds__(kThreads)
    sumsq_exact_stage1_kernel(uint64_t* __restrict__ partials, const T* __restrict__ x, int64_t n,
                              bool vec) {
  static_assert(kSumsqBlock == 64, "a half-warp of 16 lanes × 4 elements per block");
  __shared__ uint64_t smem[kThreads / kWarpSize][4];
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t pairs = (n + 2 * kSumsqBlock - 1) / (2 * kSumsqBlock);
  const int64_t warps = int64_t(gridDim.x) * (blockDim.x / kWarpSize);
  ExactSum acc;
  for (int64_t w = int64_t(blockIdx.x) * (blockDim.x / kWarpSize) + threadIdx.x / kWarpSize;
       w < pairs; w += warps) {
    const int64_t block = 2 * w + lane / 16;
    double g = group_sumsq(x, block * kSumsqBlock + 4 * (lane % 16), n, vec);
#pragma unroll
    for (int offset = 8; offset >= 1; offset /= 2)
      g = __dadd_rn(g, __shfl_down_sync(kFullMask, g, offset));
    if (lane % 16 == 0 && block * kSumsqBlock < n) acc.add_double(g);
  }
  write_block_exact(partials, acc, smem);
}

__global__ void __launch_bounds__(kReduceMaxBlocks)
    sumsq_exact_stage2_kernel(int64_t* __restrict__ out, const uint64_t* __restrict__ partials,
                              int num_partials) {
  __shared__ uint64_t smem[kReduceMaxBlocks / kWarpSize][4];
  ExactSum acc;
  for (int i = int(threadIdx.x); i < num_partials; i += int(blockDim.x)) {
    const uint64_t* p = partials + 4 * size_t(i);
    ExactSum t;
    t.words[0] = p[0], t.words[1] = p[1], t.words[2] = p[2], t.bad = p[3];
    acc.add(t);
  }
  write_block_exact(reinterpret_cast<uint64_t*>(out), acc, smem);
}

}  // namespace

void fill(void* x, uint64_t bits, size_t elem_size, int64_t n, cudaStream_t stream) {
  MOP_CHECK(n >= 0 && (x || n == 0), "fill: n = ", n);
  if (n == 0) return;
  auto launch = [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    const int64_t num_vec = aligned_to(x, 16) ? n / N : 0;
    const int64_t items = std::max(num_vec, n - num_vec * N);
    fill_kernel<T><<<grid_for(items, kThreads), kThreads, 0, stream>>>(static_cast<T*>(x), T(bits),
                                                                       n, num_vec);
  };
  switch (elem_size) {
    case 2:
      launch(uint16_t{});
      break;
    case 4:
      launch(uint32_t{});
      break;
    case 8:
      launch(uint64_t{});
      break;
    default:
      MOP_CHECK(false, "fill: element size ", elem_size);
  }
  MOP_CUDA_CHECK_LAUNCH();
}

void convert(void* dst, DType dst_dtype, const void* src, DType src_dtype, int64_t n,
             cudaStream_t stream) {
  MOP_CHECK(n >= 0 && ((dst && src) || n == 0), "convert: n = ", n);
  if (n == 0) return;
  if (dst_dtype == src_dtype) {
    MOP_CUDA_CHECK(cudaMemcpyAsync(dst, src, size_t(n) * dtype_size(src_dtype),
                                   cudaMemcpyDeviceToDevice, stream));
    return;
  }
  dispatch_float_storage(dst_dtype, [&](auto dtag) {
    dispatch_float_storage(src_dtype, [&](auto stag) {
      using D = decltype(dtag);
      using S = decltype(stag);
      constexpr int N = 16 / (sizeof(S) > sizeof(D) ? sizeof(S) : sizeof(D));
      const bool vec = aligned_to(dst, sizeof(D) * N) && aligned_to(src, sizeof(S) * N);
      const int64_t num_vec = vec ? n / N : 0;
      const int64_t items = std::max(num_vec, n - num_vec * N);
      convert_kernel<D, S><<<grid_for(items, kThreads), kThreads, 0, stream>>>(
          static_cast<D*>(dst), static_cast<const S*>(src), n, num_vec);
    });
  });
  MOP_CUDA_CHECK_LAUNCH();
}

void add(void* out, const void* a, const void* b, DType dtype, int64_t n, cudaStream_t stream) {
  MOP_CHECK(n >= 0 && ((out && a && b) || n == 0), "add: n = ", n);
  if (n == 0) return;
  dispatch_float_storage(dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    const bool vec = aligned_to(out, 16) && aligned_to(a, 16) && aligned_to(b, 16);
    const int64_t num_vec = vec ? n / N : 0;
    const int64_t items = std::max(num_vec, n - num_vec * N);
    add_kernel<T><<<grid_for(items, kThreads), kThreads, 0, stream>>>(
        static_cast<T*>(out), static_cast<const T*>(a), static_cast<const T*>(b), n, num_vec);
  });
  MOP_CUDA_CHECK_LAUNCH();
}

void reduce_sum(void* out, DType out_dtype, const void* x, DType x_dtype, int64_t n,
                double* partials, cudaStream_t stream) {
  MOP_CHECK(out && partials && n >= 0 && (x || n == 0), "reduce_sum: n = ", n);
  MOP_CHECK(out_dtype == DType::F32 || out_dtype == DType::F64, "reduce_sum: out dtype ",
            dtype_name(out_dtype));
  // The grid depends only on n and x's alignment, so the summation order does too.
  int num_blocks = 1;
  dispatch_float_storage(x_dtype, [&](auto tag) {
    using T = decltype(tag);
    constexpr int N = 16 / sizeof(T);
    const int64_t num_vec = aligned_to(x, 16) ? n / N : 0;
    const int64_t items = std::max(num_vec, n - num_vec * N);
    num_blocks = int(grid_for(items, kThreads, kReduceMaxBlocks));
    const T* px = static_cast<const T*>(x);
    reduce_stage1_kernel<T><<<num_blocks, kThreads, 0, stream>>>(partials, px, n, num_vec);
  });
  MOP_CUDA_CHECK_LAUNCH();
  if (out_dtype == DType::F32)
    reduce_stage2_kernel<float>
        <<<1, kReduceMaxBlocks, 0, stream>>>(static_cast<float*>(out), partials, num_blocks);
  else
    reduce_stage2_kernel<double>
        <<<1, kReduceMaxBlocks, 0, stream>>>(static_cast<double*>(out), partials, num_blocks);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels

namespace mop::kernels {

void sumsq_exact(int64_t* out, const void* x, DType x_dtype, int64_t n, uint64_t* partials,
                 cudaStream_t stream) {
  MOP_CHECK(out && partials && n >= 0 && (x || n == 0), "sumsq_exact: n = ", n);
  int num_blocks = 1;
  dispatch_float_storage(x_dtype, [&](auto tag) {
    using T = decltype(tag);
    const int64_t pairs = (n + 2 * kSumsqBlock - 1) / (2 * kSumsqBlock);
    num_blocks = int(grid_for(pairs, kThreads / kWarpSize, kReduceMaxBlocks));
    const bool vec = aligned_to(x, 4 * sizeof(T));
    sumsq_exact_stage1_kernel<T>
        <<<num_blocks, kThreads, 0, stream>>>(partials, static_cast<const T*>(x), n, vec);
  });
  MOP_CUDA_CHECK_LAUNCH();
  sumsq_exact_stage2_kernel<<<1, kReduceMaxBlocks, 0, stream>>>(out, partials, num_blocks);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
