// RMSNorm kernels.
// RMSNorm rows of up to 2048 (bwd) / 4096 (fwd) bf16 that are 16-byte aligned stay in registers:
// a group of kLanes lanes (a power of two, ≤ a warp) owns a row, each lane kVecs 8-wide vectors,
// so head_dim-sized rows (128 = 16 vectors) take half a warp and hidden-sized rows (2048) a warp.
// Longer or odd rows use one block per row and read the row twice (the second read hits L1/L2).
// Backward keeps each group's dw contribution in registers (or, on the block path, in shared
// memory) over a fixed set of rows, combines the groups of a block in order and writes one row
// of partials per block; a column kernel then sums the partials in block order into dw.
#include <algorithm>
#include <type_traits>

#include "runtime/cuda_check.h"
#include "kernels/elementwise.cuh"
#include "kernels/rmsnorm.cuh"

namespace mop::kernels {
namespace {

using namespace detail;
using bf16_t = __nv_bfloat16;

constexpr int kThreads = 256;
// Per-block dw partials: about kDwScratchFloats floats in all, but at least kDwMinBlocks blocks
// (block-path rows need that many to fill the GPU) and at most kDwMaxBlocks (column-sum length).
constexpr int64_t kDwScratchFloats = int64_t(1) << 19;
constexpr int64_t kDwMinBlocks = 128;
constexpr int64_t kDwMaxBlocks = 1024;
// The column sum: 32 columns per block, the partial rows split over 32 slices.
constexpr int kColTile = 32;
constexpr int kColSlices = 32;

int64_t dw_max_blocks(int64_t cols) {
  return std::clamp<int64_t>(kDwScratchFloats / std::max<int64_t>(cols, 1), kDwMinBlocks,
                             kDwMaxBlocks);
}

template <int N>
using Int = std::integral_constant<int, N>;

// Calls f(Int<kLanes>, Int<kVecs>) for the register path of a row of num_vec 8-wide vectors:
// kLanes · kVecs ≥ num_vec, kVecs ≤ kMaxVecs. Returns false when the row is too long for it.
template <int kMaxVecs, class F>
bool dispatch_rows_in_registers(int64_t num_vec, F&& f) {
  if (num_vec <= 1) return f(Int<1>{}, Int<1>{}), true;
  if (num_vec <= 2) return f(Int<2>{}, Int<1>{}), true;
  if (num_vec <= 4) return f(Int<4>{}, Int<1>{}), true;
  if (num_vec <= 8) return f(Int<8>{}, Int<1>{}), true;
  if (num_vec <= 16) return f(Int<16>{}, Int<1>{}), true;
  if (num_vec <= 32) return f(Int<32>{}, Int<1>{}), true;
  if (num_vec <= 64) return f(Int<32>{}, Int<2>{}), true;
  if (num_vec <= 128) return f(Int<32>{}, Int<4>{}), true;
  if constexpr (kMaxVecs >= 8)
    if (num_vec <= 256) return f(Int<32>{}, Int<8>{}), true;
  if constexpr (kMaxVecs >= 16)
    if (num_vec <= 512) return f(Int<32>{}, Int<16>{}), true;
  return false;
}

__device__ __forceinline__ float rms_rstd(float sum_sq, int cols, float eps) {
  return 1.0f / sqrtf(sum_sq / float(cols) + eps);  // the reference's formula, IEEE div and sqrt
}

// ---- forward ----------------------------------------------------------------------------------

// No __restrict__ on y and x, here and in the block kernel: y may be x (each element is read
// before the same thread writes it).
template <int kLanes, int kVecs>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_fwd_reg_kernel(bf16_t* y, float* __restrict__ rstd, const bf16_t* x,
                           const bf16_t* __restrict__ w, int64_t rows, int cols, float eps) {
  constexpr int kGroups = kThreads / kLanes;
  const int lane = int(threadIdx.x) % kLanes;
  const int64_t row = int64_t(blockIdx.x) * kGroups + threadIdx.x / kLanes;
  // Rows past the end still take part in the group shuffles (full-warp masks), with zeros.
  const bool valid = row < rows;
  const int num_vec = cols / 8;
  const bf16_t* xr = x + (valid ? row : 0) * cols;
  uint4 xv[kVecs];
  float ss = 0;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int v = lane + k * kLanes;
    xv[k] = make_uint4(0, 0, 0, 0);
    if (valid && v < num_vec) xv[k] = load_bf16x8(xr + v * 8);
    float f[8];
    unpack_bf16x8(xv[k], f);
#pragma unroll
    for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
  }
  ss = group_sum<kLanes>(ss);
  if (!valid) return;
  const float r = rms_rstd(ss, cols, eps);
  if (lane == 0) rstd[row] = r;
  bf16_t* yr = y + row * cols;
#pragma unroll
  for (int k = 0; k < kVecs; ++k) {
    const int v = lane + k * kLanes;
    if (v >= num_vec) continue;
    float xf[8], wf[8], yf[8];
    unpack_bf16x8(xv[k], xf);
    unpack_bf16x8(load_bf16x8(w + v * 8), wf);
#pragma unroll
    for (int e = 0; e < 8; ++e) yf[e] = xf[e] * r * wf[e];
    store_bf16x8(yr + v * 8, pack_bf16x8(yf));
  }
}

// One block per row (grid-stride), two passes over x. kVec 8: aligned 8-wide vectors; 1: scalars.
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_fwd_block_kernel(bf16_t* y, float* __restrict__ rstd, const bf16_t* x,
                             const bf16_t* __restrict__ w, int64_t rows, int cols, float eps) {
  __shared__ float red[kWarpSize];
  const int num_vec = cols / kVec;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const bf16_t* xr = x + row * cols;
    bf16_t* yr = y + row * cols;
    float ss = 0;
    for (int v = int(threadIdx.x); v < num_vec; v += kThreads) {
      if constexpr (kVec == 8) {
        float f[8];
        unpack_bf16x8(load_bf16x8(xr + v * 8), f);
#pragma unroll
        for (int e = 0; e < 8; ++e) ss += f[e] * f[e];
      } else {
        const float f = bf16_to_float(xr[v]);
        ss += f * f;
      }
    }
    ss = block_sum(ss, red);
    const float r = rms_rstd(ss, cols, eps);
    if (threadIdx.x == 0) rstd[row] = r;
    for (int v = int(threadIdx.x); v < num_vec; v += kThreads) {
      if constexpr (kVec == 8) {
        float xf[8], wf[8], yf[8];
        unpack_bf16x8(load_bf16x8(xr + v * 8), xf);
        unpack_bf16x8(load_bf16x8(w + v * 8), wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) yf[e] = xf[e] * r * wf[e];
        store_bf16x8(yr + v * 8, pack_bf16x8(yf));
      } else {
        yr[v] = float_to_bf16(bf16_to_float(xr[v]) * r * bf16_to_float(w[v]));
      }
    }
  }
}

// ---- backward ---------------------------------------------------------------------------------
// Per row, with g = dy·w and x̂ = x·r:  dx = r·(g − x̂·mean(g·x̂)), dw += dy·x·r — the reference's
// operation order: dot += (dy·w)·(x·r); d = r·(g − (x·r)·mean); dw += (dy·x)·r.

__device__ __forceinline__ float rms_dx(float x, float dy, float w, float r, float mean) {
  return r * (dy * w - x * r * mean);
}

// Group gid = blockIdx.x·kGroups + group takes rows gid, gid + G, gid + 2G, … (G groups in all),
// so the rows behind each partial depend only on the grid, which depends only on rows and cols.
// No __restrict__ on dx and dy: they may alias (a row is fully read before any of it is written).
template <int kLanes, int kVecs>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_bwd_reg_kernel(bf16_t* dx, float* __restrict__ partial, const bf16_t* dy,
                           const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                           const float* __restrict__ rstd, int64_t rows, int cols,
                           bool accumulate) {
  constexpr int kGroups = kThreads / kLanes;
  __shared__ float dw_block[kLanes * kVecs * 8];
  const int lane = int(threadIdx.x) % kLanes, group = int(threadIdx.x) / kLanes;
  const int num_vec = cols / 8;
  const int64_t row_step = int64_t(gridDim.x) * kGroups;
  // dw stays in registers over all of the group's rows; w is re-read per row (an L1 hit), as
  // holding it too would spill at 2048 columns.
  float dw_acc[kVecs][8];
#pragma unroll
  for (int k = 0; k < kVecs; ++k)
#pragma unroll
    for (int e = 0; e < 8; ++e) dw_acc[k][e] = 0;
  // row0 is the same for the whole block, so every lane runs the same iterations (shuffles).
  for (int64_t row0 = int64_t(blockIdx.x) * kGroups; row0 < rows; row0 += row_step) {
    const int64_t row = row0 + group;
    const bool valid = row < rows;
    const int64_t base = (valid ? row : 0) * cols;
    const float r = valid ? rstd[row] : 0.0f;
    uint4 xv[kVecs], dyv[kVecs];
    float dot = 0;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = lane + k * kLanes;
      const bool in = valid && v < num_vec;
      xv[k] = in ? load_bf16x8(x + base + v * 8) : make_uint4(0, 0, 0, 0);
      dyv[k] = in ? load_bf16x8(dy + base + v * 8) : make_uint4(0, 0, 0, 0);
      if (!in) continue;
      float xf[8], dyf[8], wf[8];
      unpack_bf16x8(xv[k], xf);
      unpack_bf16x8(dyv[k], dyf);
      unpack_bf16x8(load_bf16x8(w + v * 8), wf);
#pragma unroll
      for (int e = 0; e < 8; ++e) dot += (dyf[e] * wf[e]) * (xf[e] * r);
    }
    dot = group_sum<kLanes>(dot);
    if (!valid) continue;
    const float mean = dot / float(cols);
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = lane + k * kLanes;
      if (v >= num_vec) continue;
      float xf[8], dyf[8], wf[8], dxf[8] = {};
      unpack_bf16x8(xv[k], xf);
      unpack_bf16x8(dyv[k], dyf);
      unpack_bf16x8(load_bf16x8(w + v * 8), wf);
      if (accumulate) unpack_bf16x8(load_bf16x8(dx + base + v * 8), dxf);
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        const float d = rms_dx(xf[e], dyf[e], wf[e], r, mean);
        dxf[e] = accumulate ? dxf[e] + d : d;
        dw_acc[k][e] += dyf[e] * xf[e] * r;
      }
      store_bf16x8(dx + base + v * 8, pack_bf16x8(dxf));
    }
  }
  // The block's groups add their dw into shared memory one after another, in group order.
  for (int g = 0; g < kGroups; ++g) {
    __syncthreads();
    if (group != g) continue;
#pragma unroll
    for (int k = 0; k < kVecs; ++k) {
      const int v = lane + k * kLanes;
      if (v >= num_vec) continue;
#pragma unroll
      for (int e = 0; e < 8; ++e)
        dw_block[v * 8 + e] = g == 0 ? dw_acc[k][e] : dw_block[v * 8 + e] + dw_acc[k][e];
    }
  }
  __syncthreads();
  for (int c = int(threadIdx.x); c < cols; c += kThreads)
    partial[int64_t(blockIdx.x) * cols + c] = dw_block[c];
}

// One block per row (grid-stride over a fixed set of rows), two passes over x and dy; the block's
// dw lives in dynamic shared memory [cols], each column owned by one thread (no barriers needed).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    rmsnorm_bwd_block_kernel(bf16_t* dx, float* __restrict__ partial, const bf16_t* dy,
                             const bf16_t* __restrict__ x, const bf16_t* __restrict__ w,
                             const float* __restrict__ rstd, int64_t rows, int cols,
                             bool accumulate) {
  extern __shared__ float dw_block[];
  __shared__ float red[kWarpSize];
  const int num_vec = cols / kVec;
  for (int v = int(threadIdx.x); v < num_vec; v += kThreads) {
#pragma unroll
    for (int e = 0; e < kVec; ++e) dw_block[v * kVec + e] = 0;
  }
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t base = row * cols;
    const float r = rstd[row];
    float dot = 0;
    for (int v = int(threadIdx.x); v < num_vec; v += kThreads) {
      if constexpr (kVec == 8) {
        float xf[8], dyf[8], wf[8];
        unpack_bf16x8(load_bf16x8(x + base + v * 8), xf);
        unpack_bf16x8(load_bf16x8(dy + base + v * 8), dyf);
        unpack_bf16x8(load_bf16x8(w + v * 8), wf);
#pragma unroll
        for (int e = 0; e < 8; ++e) dot += (dyf[e] * wf[e]) * (xf[e] * r);
      } else {
        dot +=
            (bf16_to_float(dy[base + v]) * bf16_to_float(w[v])) * (bf16_to_float(x[base + v]) * r);
      }
    }
    // The barriers in block_sum also order this row's reads of dy before any write of dx.
    dot = block_sum(dot, red);
    const float mean = dot / float(cols);
    for (int v = int(threadIdx.x); v < num_vec; v += kThreads) {
      if constexpr (kVec == 8) {
        float xf[8], dyf[8], wf[8], dxf[8] = {};
        unpack_bf16x8(load_bf16x8(x + base + v * 8), xf);
        unpack_bf16x8(load_bf16x8(dy + base + v * 8), dyf);
        unpack_bf16x8(load_bf16x8(w + v * 8), wf);
        if (accumulate) unpack_bf16x8(load_bf16x8(dx + base + v * 8), dxf);
#pragma unroll
        for (int e = 0; e < 8; ++e) {
          const float d = rms_dx(xf[e], dyf[e], wf[e], r, mean);
          dxf[e] = accumulate ? dxf[e] + d : d;
          dw_block[v * 8 + e] += dyf[e] * xf[e] * r;
        }
        store_bf16x8(dx + base + v * 8, pack_bf16x8(dxf));
      } else {
        const float xf = bf16_to_float(x[base + v]), dyf = bf16_to_float(dy[base + v]);
        const float d = rms_dx(xf, dyf, bf16_to_float(w[v]), r, mean);
        dx[base + v] = float_to_bf16(accumulate ? bf16_to_float(dx[base + v]) + d : d);
        dw_block[v] += dyf * xf * r;
      }
    }
  }
  for (int v = int(threadIdx.x); v < num_vec; v += kThreads) {
#pragma unroll
    for (int e = 0; e < kVec; ++e)
      partial[int64_t(blockIdx.x) * cols + v * kVec + e] = dw_block[v * kVec + e];
  }
}

// dw[c] += Σ_b partial[b, c]: slice s sums b = s, s + 32, … in order; the slices are then added in
// slice order. A warp reads 32 consecutive columns (128 bytes) of one partial row.
__global__ void __launch_bounds__(kColTile* kColSlices)
    dw_column_sum_kernel(float* __restrict__ dw, const float* __restrict__ partial,
                         int num_partials, int cols) {
  __shared__ float sums[kColSlices][kColTile + 1];
  const int cx = int(threadIdx.x) % kColTile, slice = int(threadIdx.x) / kColTile;
  const int c = int(blockIdx.x) * kColTile + cx;
  float acc = 0;
  if (c < cols) {
#pragma unroll 4
    for (int b = slice; b < num_partials; b += kColSlices) acc += partial[int64_t(b) * cols + c];
  }
  sums[slice][cx] = acc;
  __syncthreads();
  if (slice == 0 && c < cols) {
    float total = sums[0][cx];
    for (int s = 1; s < kColSlices; ++s) total += sums[s][cx];
    dw[c] += total;
  }
}

}  // namespace

void rmsnorm_fwd(bf16_t* y, float* rstd, const bf16_t* x, const bf16_t* w, int64_t rows,
                 int64_t cols, float eps, cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && cols > 0 && cols < (int64_t(1) << 30), "rmsnorm_fwd: ", rows, "×", cols);
  if (rows == 0) return;
  MOP_CHECK(y && rstd && x && w, "rmsnorm_fwd: null pointer");
  const int c = int(cols);
  const bool vec = cols % 8 == 0 && aligned_to(y, 16) && aligned_to(x, 16) && aligned_to(w, 16);
  const bool in_registers =
      vec && dispatch_rows_in_registers<16>(cols / 8, [&](auto lanes, auto vecs) {
        constexpr int kLanes = decltype(lanes)::value, kVecs = decltype(vecs)::value;
        constexpr int kGroups = kThreads / kLanes;
        const int64_t blocks = (rows + kGroups - 1) / kGroups;
        rmsnorm_fwd_reg_kernel<kLanes, kVecs>
            <<<unsigned(blocks), kThreads, 0, stream>>>(y, rstd, x, w, rows, c, eps);
      });
  if (!in_registers) {
    const unsigned blocks = unsigned(std::min<int64_t>(rows, 8192));
    if (vec)
      rmsnorm_fwd_block_kernel<8><<<blocks, kThreads, 0, stream>>>(y, rstd, x, w, rows, c, eps);
    else
      rmsnorm_fwd_block_kernel<1><<<blocks, kThreads, 0, stream>>>(y, rstd, x, w, rows, c, eps);
  }
  MOP_CUDA_CHECK_LAUNCH();
}

int64_t rmsnorm_bwd_scratch_floats(int64_t rows, int64_t cols) {
  if (rows <= 0 || cols <= 0) return 0;
  // Both paths launch at most min(rows, dw_max_blocks(cols)) blocks.
  return std::min(rows, dw_max_blocks(cols)) * cols;
}

void rmsnorm_bwd(bf16_t* dx, float* dw, const bf16_t* dy, const bf16_t* x, const bf16_t* w,
                 const float* rstd, int64_t rows, int64_t cols, bool accumulate_dx, float* scratch,
                 int64_t scratch_floats, cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && cols > 0 && cols < (int64_t(1) << 30), "rmsnorm_bwd: ", rows, "×", cols);
  if (rows == 0) return;
  MOP_CHECK(dx && dw && dy && x && w && rstd && scratch, "rmsnorm_bwd: null pointer");
  MOP_CHECK(scratch_floats >= rmsnorm_bwd_scratch_floats(rows, cols), "rmsnorm_bwd: scratch of ",
            scratch_floats, " floats, needs ", rmsnorm_bwd_scratch_floats(rows, cols));
  const int c = int(cols);
  const int64_t max_blocks = dw_max_blocks(cols);
  const bool vec = cols % 8 == 0 && aligned_to(dx, 16) && aligned_to(dy, 16) && aligned_to(x, 16) &&
                   aligned_to(w, 16);
  int64_t blocks = 0;
  const bool in_registers =
      vec && dispatch_rows_in_registers<8>(cols / 8, [&](auto lanes, auto vecs) {
        constexpr int kLanes = decltype(lanes)::value, kVecs = decltype(vecs)::value;
        constexpr int kGroups = kThreads / kLanes;
        blocks = std::min((rows + kGroups - 1) / kGroups, max_blocks);
        rmsnorm_bwd_reg_kernel<kLanes, kVecs><<<unsigned(blocks), kThreads, 0, stream>>>(
            dx, scratch, dy, x, w, rstd, rows, c, accumulate_dx);
      });
  if (!in_registers) {
    blocks = std::min(rows, max_blocks);
    const size_t smem = size_t(cols) * sizeof(float);
    MOP_CHECK(smem <= size_t(200) << 10, "rmsnorm_bwd: rows of ", cols, " are too long");
    auto launch = [&](auto kernel) {
      if (smem > size_t(48) << 10)
        MOP_CUDA_CHECK(
            cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, int(smem)));
      kernel<<<unsigned(blocks), kThreads, smem, stream>>>(dx, scratch, dy, x, w, rstd, rows, c,
                                                           accumulate_dx);
    };
    if (vec)
      launch(rmsnorm_bwd_block_kernel<8>);
    else
      launch(rmsnorm_bwd_block_kernel<1>);
  }
  MOP_CUDA_CHECK_LAUNCH();
  dw_column_sum_kernel<<<unsigned((cols + kColTile - 1) / kColTile), kColTile * kColSlices, 0,
                         stream>>>(dw, scratch, int(blocks), c);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
