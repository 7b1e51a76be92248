// SwiGLU kernels: h = silu(g)·u over gu = [g | u] and its backward, one warp per row, bf16 data
// with fp32 math.
#include "kernels/elementwise.cuh"
#include "kernels/swiglu.cuh"
#include "runtime/cuda_check.h"

namespace mop::kernels {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kWarpsPerBlock = kThreads / kWarpSize;

// σ(x) = 1/(1 + e^-x) with the fast exponential (≤ 2 + 1.16|x| ulp, far below the bf16 output's
// 2^-9): SwiGLU runs at bandwidth, and the special-function unit would otherwise be its limit.
__device__ __forceinline__ float sigmoid(float x) {
  return __frcp_rn(1.0f + __expf(-x));
}

// Operation order as the CPU reference: h = (g·σ)·u.
__device__ __forceinline__ float swiglu_value(float g, float u) {
  return g * sigmoid(g) * u;
}

// dg = ((dh·u)·σ)·(1 + g·(1 − σ)),  du = (dh·g)·σ.
__device__ __forceinline__ void swiglu_grad(float g, float u, float d, float& dg, float& du) {
  const float sig = sigmoid(g);
  dg = d * u * sig * (1.0f + g * (1.0f - sig));
  du = d * g * sig;
}

// One warp per row; kVec = 8 moves 16-byte vectors (width % 8 == 0, aligned), kVec = 1 elements.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_fwd_kernel(__nv_bfloat16* __restrict__ h, const __nv_bfloat16* __restrict__ gu,
                      int64_t rows, int64_t width) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const int64_t num_vec = width / kVec;
  for (int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += num_warps) {
    const __nv_bfloat16* g = gu + r * 2 * width;
    const __nv_bfloat16* u = g + width;
    __nv_bfloat16* out = h + r * width;
    for (int64_t v = lane; v < num_vec; v += kWarpSize) {
      if constexpr (kVec == 8) {
        float gf[8], uf[8], hf[8];
        unpack_bf16x8(load_bf16x8(g + v * 8), gf);
        unpack_bf16x8(load_bf16x8(u + v * 8), uf);
#pragma unroll
        for (int k = 0; k < 8; ++k) hf[k] = swiglu_value(gf[k], uf[k]);
        store_bf16x8(out + v * 8, pack_bf16x8(hf));
      } else {
        out[v] = float_to_bf16(swiglu_value(bf16_to_float(g[v]), bf16_to_float(u[v])));
      }
    }
  }
}

// No __restrict__ on dgu and gu: they may alias (a thread reads g and u of its columns before it
// writes dg and du of the same columns; no other thread touches them).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    swiglu_bwd_kernel(__nv_bfloat16* dgu, const __nv_bfloat16* __restrict__ dh,
                      const __nv_bfloat16* gu, int64_t rows, int64_t width) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t num_warps = int64_t(gridDim.x) * kWarpsPerBlock;
  const int64_t num_vec = width / kVec;
  for (int64_t r = int64_t(blockIdx.x) * kWarpsPerBlock + threadIdx.x / kWarpSize; r < rows;
       r += num_warps) {
    const __nv_bfloat16* g = gu + r * 2 * width;
    const __nv_bfloat16* u = g + width;
    const __nv_bfloat16* d = dh + r * width;
    __nv_bfloat16* dg = dgu + r * 2 * width;
    __nv_bfloat16* du = dg + width;
    for (int64_t v = lane; v < num_vec; v += kWarpSize) {
      if constexpr (kVec == 8) {
        float gf[8], uf[8], df[8], dgf[8], duf[8];
        unpack_bf16x8(load_bf16x8(g + v * 8), gf);
        unpack_bf16x8(load_bf16x8(u + v * 8), uf);
        unpack_bf16x8(load_bf16x8(d + v * 8), df);
#pragma unroll
        for (int k = 0; k < 8; ++k) swiglu_grad(gf[k], uf[k], df[k], dgf[k], duf[k]);
        store_bf16x8(dg + v * 8, pack_bf16x8(dgf));
        store_bf16x8(du + v * 8, pack_bf16x8(duf));
      } else {
        float dgv, duv;
        swiglu_grad(bf16_to_float(g[v]), bf16_to_float(u[v]), bf16_to_float(d[v]), dgv, duv);
        dg[v] = float_to_bf16(dgv);
        du[v] = float_to_bf16(duv);
      }
    }
  }
}

}  // namespace

void swiglu_fwd(__nv_bfloat16* h, const __nv_bfloat16* gu, int64_t rows, int64_t width,
                cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && width >= 0 && ((h && gu) || rows * width == 0), "swiglu_fwd: ", rows, "×",
            width);
  if (rows == 0 || width == 0) return;
  const unsigned blocks = grid_for(rows, kWarpsPerBlock);
  if (width % 8 == 0 && aligned_to(h, 16) && aligned_to(gu, 16))
    swiglu_fwd_kernel<8><<<blocks, kThreads, 0, stream>>>(h, gu, rows, width);
  else
    swiglu_fwd_kernel<1><<<blocks, kThreads, 0, stream>>>(h, gu, rows, width);
  MOP_CUDA_CHECK_LAUNCH();
}

void swiglu_bwd(__nv_bfloat16* dgu, const __nv_bfloat16* dh, const __nv_bfloat16* gu, int64_t rows,
                int64_t width, cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && width >= 0 && ((dgu && dh && gu) || rows * width == 0),
            "swiglu_bwd: ", rows, "×", width);
  if (rows == 0 || width == 0) return;
  const unsigned blocks = grid_for(rows, kWarpsPerBlock);
  if (width % 8 == 0 && aligned_to(dgu, 16) && aligned_to(dh, 16) && aligned_to(gu, 16))
    swiglu_bwd_kernel<8><<<blocks, kThreads, 0, stream>>>(dgu, dh, gu, rows, width);
  else
    swiglu_bwd_kernel<1><<<blocks, kThreads, 0, stream>>>(dgu, dh, gu, rows, width);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
