// RoPE kernel: rotates the (i, i + dim/2) pairs of every head of a token in place, with the
// token's cos/sin table in shared memory.
#include <algorithm>

#include "kernels/elementwise.cuh"
#include "kernels/rope.cuh"
#include "runtime/cuda_check.h"

namespace mop::kernels {
namespace {

using namespace detail;
using bf16_t = __nv_bfloat16;

constexpr int kThreads = 256;
// Largest cos+sin table a rope block holds (floats per table): 16 KB each.
constexpr int kRopeTableFloats = 4096;

// A block rotates tokens [t0, t0 + tokens_per_block): first the cos/sin of each (token, i) into
// shared memory (fp64 sincos of the fp32 angle, rounded once to fp32: the reference takes
// std::cos/std::sin of the same double and rounds to float, and CUDA's fp64 sincos, within 2 fp64
// ulps, rounds to the same float unless the exact value lies within those 2 ulps of a midpoint
// between floats — about one angle in 2^28 — and then differs by one fp32 ulp), then every
// (token, head, vector of i) task. kVec 8: 16-byte vectors of each half; 1: scalars.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rope_kernel(bf16_t* __restrict__ x, const int32_t* __restrict__ pos,
                const float* __restrict__ inv_freq, int64_t tokens, int heads, int dim,
                int tokens_per_block, bool inverse) {
  extern __shared__ float tables[];  // cos [tokens_per_block][half], then sin, same shape
  const int half = dim / 2;
  float* cos_tab = tables;
  float* sin_tab = tables + tokens_per_block * half;
  const int64_t t0 = int64_t(blockIdx.x) * tokens_per_block;
  for (int j = int(threadIdx.x); j < tokens_per_block * half; j += kThreads) {
    const int64_t t = t0 + j / half;
    if (t >= tokens) break;  // j only grows
    const float angle = __fmul_rn(float(pos[t]), inv_freq[j % half]);
    double s, c;
    sincos(double(angle), &s, &c);
    cos_tab[j] = float(c);
    // The inverse rotation is the rotation by −angle: cos is even, sin odd.
    sin_tab[j] = inverse ? -float(s) : float(s);
  }
  __syncthreads();
  const int num_vec = half / kVec;
  const int per_token = heads * num_vec;
  for (int task = int(threadIdx.x); task < tokens_per_block * per_token; task += kThreads) {
    const int tt = task / per_token, rem = task % per_token;
    const int64_t t = t0 + tt;
    if (t >= tokens) break;  // tasks are ordered by token
    const int h = rem / num_vec, i0 = (rem % num_vec) * kVec;
    bf16_t* row = x + (t * heads + h) * dim;
    const float* cs = cos_tab + tt * half + i0;
    const float* sn = sin_tab + tt * half + i0;
    // y1 = x1·cos − x2·sin, y2 = x2·cos + x1·sin, each product and sum rounded (no FMA), as the
    // reference computes them in fp32.
    if constexpr (kVec == 8) {
      float x1[8], x2[8], y1[8], y2[8];
      unpack_bf16x8(load_bf16x8(row + i0), x1);
      unpack_bf16x8(load_bf16x8(row + half + i0), x2);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        y1[e] = __fsub_rn(__fmul_rn(x1[e], cs[e]), __fmul_rn(x2[e], sn[e]));
        y2[e] = __fadd_rn(__fmul_rn(x2[e], cs[e]), __fmul_rn(x1[e], sn[e]));
      }
      store_bf16x8(row + i0, pack_bf16x8(y1));
      store_bf16x8(row + half + i0, pack_bf16x8(y2));
    } else {
      const float x1 = bf16_to_float(row[i0]), x2 = bf16_to_float(row[half + i0]);
      row[i0] = float_to_bf16(__fsub_rn(__fmul_rn(x1, cs[0]), __fmul_rn(x2, sn[0])));
      row[half + i0] = float_to_bf16(__fadd_rn(__fmul_rn(x2, cs[0]), __fmul_rn(x1, sn[0])));
    }
  }
}

}  // namespace

void rope(bf16_t* x, const int32_t* pos, const float* inv_freq, int64_t tokens, int64_t heads,
          int64_t dim, bool inverse, cudaStream_t stream) {
  MOP_CHECK(tokens >= 0 && heads >= 0 && dim > 0 && dim % 2 == 0 && dim / 2 <= kRopeMaxHalfDim,
            "rope: x [", tokens, ",", heads, ",", dim, "]");
  if (tokens == 0 || heads == 0) return;
  MOP_CHECK(x && pos && inv_freq, "rope: null pointer");
  const int half = int(dim / 2);
  const bool vec = half % 8 == 0 && aligned_to(x, 16);
  const int64_t per_token = heads * (vec ? half / 8 : half);
  // Enough tokens per block to give every thread a task, within the shared cos/sin tables.
  const int64_t max_tokens = std::max(1, kRopeTableFloats / half);
  const int tokens_per_block =
      int(std::clamp<int64_t>((kThreads + per_token - 1) / per_token, 1, max_tokens));
  MOP_CHECK(tokens_per_block * per_token < (int64_t(1) << 31), "rope: too many heads: ", heads);
  const unsigned blocks = unsigned((tokens + tokens_per_block - 1) / tokens_per_block);
  const size_t smem = 2 * size_t(tokens_per_block) * size_t(half) * sizeof(float);
  if (vec)
    rope_kernel<8><<<blocks, kThreads, smem, stream>>>(x, pos, inv_freq, tokens, int(heads),
                                                       int(dim), tokens_per_block, inverse);
  else
    rope_kernel<1><<<blocks, kThreads, smem, stream>>>(x, pos, inv_freq, tokens, int(heads),
                                                       int(dim), tokens_per_block, inverse);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
