// Router kernels (router.cuh). Forward and backward run one warp per token with the token's
// experts striped over the lanes (expert e at lane e % 32, register e / 32), so the softmax sums
// and the top-k argmax rounds are warp shuffles. The aux loss sums probability columns per row
// chunk, then the chunks in order in one block. No float atomics anywhere: bitwise reproducible.
// Where the CPU reference (src/ops/cpu/router.cpp) sums in order, the kernels do too, with
// __fmul_rn/__fadd_rn so nvcc does not contract a·b + c into an FMA the reference does not have.
#include "kernels/router.cuh"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

#include "runtime/cuda_check.h"
#include "core/error.h"

namespace mop::kernels {
namespace {

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kRouterWarps = 8;  // tokens per 256-thread block

// Aux loss: rows are cut into at most kAuxMaxChunks chunks of at least kAuxMinRows rows (fewer
// and the single-block finish dominates); a stage-1 block sums kAuxCols columns of one chunk with
// kAuxRows threads per column. The cut depends on T only, so the summation order is fixed.
constexpr int kAuxMaxChunks = 128;
constexpr int kAuxMinRows = 64;
constexpr int kAuxCols = 32;
constexpr int kAuxRows = 8;
constexpr int kAuxThreads = kAuxCols * kAuxRows;
constexpr int kAuxFinishThreads = 256;

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, m));
  return v;
}

// Butterfly sum: a fixed order, and every lane ends with the same bits (a + b == b + a exactly).
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

__device__ __forceinline__ unsigned long long warp_max_u64(unsigned long long v) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m >>= 1) {
    const unsigned long long o = __shfl_xor_sync(kFullMask, v, m);
    v = o > v ? o : v;
  }
  return v;
}

// Top-k key: the probability's bits above ~expert. For p ≥ 0 the bits order like the values, and
// ~e makes the lower index win a tie, exactly the reference's order. 0 marks an expert already
// taken (or a lane past E): every real key is larger, its low word being ≥ ~1023.
__device__ __forceinline__ unsigned long long topk_key(float p, int e) {
  return (static_cast<unsigned long long>(__float_as_uint(p)) << 32) | static_cast<unsigned>(~e);
}

template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarps* kWarp)
    router_fwd_kernel(int32_t* __restrict__ topk_idx /*[T,K]*/,
                      float* __restrict__ topk_w /*[T,K]*/, float* __restrict__ probs /*[T,E]*/,
                      float* __restrict__ lse /*[T]*/, const float* __restrict__ logits /*[T,E]*/,
                      int num_tokens, int num_experts, int top_k, bool renormalize) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = int64_t(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp;
  if (t >= num_tokens) return;  // whole warps leave; no block barrier follows
  const float* z = logits + t * num_experts;
  float v[kPerLane];
  float m = -INFINITY;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarp + lane;
    v[i] = e < num_experts ? z[e] : -INFINITY;
    m = fmaxf(m, v[i]);
  }
  m = warp_max(m);
  float s = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarp + lane;
    v[i] = e < num_experts ? expf(v[i] - m) : 0.f;
    s += v[i];
  }
  s = warp_sum(s);
  float* p_row = probs + t * num_experts;
  unsigned long long key[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarp + lane;
    v[i] /= s;
    key[i] = e < num_experts ? topk_key(v[i], e) : 0ull;
    if (e < num_experts) p_row[e] = v[i];
  }
  if (lane == 0) lse[t] = m + logf(s);

  // K rounds of warp argmax. Every lane sees each winner, so each sums `sel` in k order like the
  // reference; lane k % 32 writes round k and later rescales what it wrote itself.
  int32_t* idx_row = topk_idx + t * top_k;
  float* w_row = topk_w + t * top_k;
  float sel = 0;
  for (int k = 0; k < top_k; ++k) {
    unsigned long long best = key[0];
#pragma unroll
    for (int i = 1; i < kPerLane; ++i) best = key[i] > best ? key[i] : best;
    best = warp_max_u64(best);
    const int e = static_cast<int>(~static_cast<unsigned>(best));
    const float p = __uint_as_float(static_cast<unsigned>(best >> 32));
#pragma unroll
    for (int i = 0; i < kPerLane; ++i)
      if (i * kWarp + lane == e) key[i] = 0;
    if (lane == k % kWarp) {
      idx_row[k] = e;
      w_row[k] = p;
    }
    sel += p;
  }
  if (renormalize)
    for (int k = lane; k < top_k; k += kWarp) w_row[k] /= sel;
}

template <int kPerLane>
__global__ void __launch_bounds__(kRouterWarps* kWarp)
    router_bwd_kernel(float* __restrict__ dlogits /*[T,E]*/, const float* __restrict__ dtopk_w,
                      const float* __restrict__ probs, const float* __restrict__ lse,
                      const int32_t* __restrict__ topk_idx, const float* __restrict__ topk_w,
                      const float* __restrict__ aux_grad /*[E]*/, float z_grad_scale,
                      int num_tokens, int num_experts, int top_k, bool renormalize) {
  const int lane = threadIdx.x % kWarp;
  const int64_t t = int64_t(blockIdx.x) * kRouterWarps + threadIdx.x / kWarp;
  if (t >= num_tokens) return;
  const float* p_row = probs + t * num_experts;
  const int32_t* idx_row = topk_idx + t * top_k;
  const float* dw_row = dtopk_w + t * top_k;
  const float* w_row = topk_w + t * top_k;
  float p[kPerLane], dp[kPerLane];
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarp + lane;
    p[i] = e < num_experts ? p_row[e] : 0.f;
    dp[i] = e < num_experts ? aux_grad[e] : 0.f;
  }
  // Renormalisation w_k = p_k / s: s = Σ_k p[idx_k] and dot = Σ_k dw_k·w_k, both in k order.
  // Lanes load 32 selections at a time and broadcast them one by one. Indices outside [0, E)
  // (a broken caller) are skipped rather than read out of bounds.
  float s = 1, dot = 0;
  if (renormalize) {
    s = 0;
    for (int k0 = 0; k0 < top_k; k0 += kWarp) {
      const int k = k0 + lane;
      float pk = 0, dwk = 0, wk = 0;
      if (k < top_k) {
        const int e = idx_row[k];
        pk = (e >= 0 && e < num_experts) ? p_row[e] : 0.f;
        dwk = dw_row[k];
        wk = w_row[k];
      }
      const int n = min(kWarp, top_k - k0);
      for (int j = 0; j < n; ++j) {
        s += __shfl_sync(kFullMask, pk, j);
        dot = __fadd_rn(dot,
                        __fmul_rn(__shfl_sync(kFullMask, dwk, j), __shfl_sync(kFullMask, wk, j)));
      }
    }
  }
  // dp[idx_k] += (dw_k − dot)/s (or dw_k), in k order: dp matches the reference bit for bit.
  for (int k0 = 0; k0 < top_k; k0 += kWarp) {
    const int k = k0 + lane;
    int ek = -1;
    float dwk = 0;
    if (k < top_k) {
      ek = idx_row[k];
      dwk = dw_row[k];
    }
    const int n = min(kWarp, top_k - k0);
    for (int j = 0; j < n; ++j) {
      const int e = __shfl_sync(kFullMask, ek, j);
      const float dwj = __shfl_sync(kFullMask, dwk, j);
      const float term = renormalize ? (dwj - dot) / s : dwj;
#pragma unroll
      for (int i = 0; i < kPerLane; ++i)
        if (i * kWarp + lane == e) dp[i] += term;
    }
  }
  // Softmax backward and the z-loss: dz = p·(dp − Σ p·dp) + (z_grad_scale·2·lse)·p. Only Σ p·dp
  // is summed in a different order than the reference (lanes, then a butterfly).
  float pdp = 0;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) pdp += p[i] * dp[i];
  pdp = warp_sum(pdp);
  const float z_coef = z_grad_scale * 2.f * lse[t];
  float* dz = dlogits + t * num_experts;
#pragma unroll
  for (int i = 0; i < kPerLane; ++i) {
    const int e = i * kWarp + lane;
    if (e < num_experts)
      dz[e] = __fadd_rn(__fmul_rn(p[i], __fsub_rn(dp[i], pdp)), __fmul_rn(z_coef, p[i]));
  }
}

// Stage 1: col_partial[chunk, e] = Σ_{r in chunk} probs[r, e]; z_partial[chunk] = Σ lse[r]².
// Grid (ceil(E/32), chunks), block (32, 8): a warp reads 32 consecutive columns of one row.
__global__ void __launch_bounds__(kAuxThreads)
    aux_colsum_kernel(float* __restrict__ col_partial /*[chunks,E]*/,
                      float* __restrict__ z_partial /*[chunks]*/, const float* __restrict__ probs,
                      const float* __restrict__ lse, int num_tokens, int num_experts,
                      int rows_per_chunk) {
  __shared__ float part[kAuxRows][kAuxCols];
  __shared__ float zpart[kAuxThreads];
  const int x = threadIdx.x, y = threadIdx.y, flat = y * kAuxCols + x;
  const int e = blockIdx.x * kAuxCols + x;
  const int r0 = blockIdx.y * rows_per_chunk;
  const int r1 = min(r0 + rows_per_chunk, num_tokens);
  float acc = 0;
  if (e < num_experts) {
#pragma unroll 4
    for (int r = r0 + y; r < r1; r += kAuxRows) acc += probs[int64_t(r) * num_experts + e];
  }
  part[y][x] = acc;
  const bool z_block = blockIdx.x == 0;  // block-uniform: the barriers below are safe
  if (z_block) {
    float z = 0;
    for (int r = r0 + flat; r < r1; r += kAuxThreads) z += lse[r] * lse[r];
    zpart[flat] = z;
  }
  __syncthreads();
  if (y == 0 && e < num_experts) {
    float total = 0;
#pragma unroll
    for (int j = 0; j < kAuxRows; ++j) total += part[j][x];
    col_partial[int64_t(blockIdx.y) * num_experts + e] = total;
  }
  if (z_block) {
    for (int stride = kAuxThreads / 2; stride > 0; stride >>= 1) {
      if (flat < stride) zpart[flat] += zpart[flat + stride];
      __syncthreads();
    }
    if (flat == 0) z_partial[blockIdx.y] = zpart[0];
  }
}

// Stage 2 (one block): column totals over the chunks in order, the balance term, aux_grad (the
// reference's expression, so bitwise equal), and the two losses.
__global__ void __launch_bounds__(kAuxFinishThreads)
    aux_finish_kernel(float* __restrict__ losses /*[2]*/, float* __restrict__ aux_grad /*[E]*/,
                      const float* __restrict__ col_partial, const float* __restrict__ z_partial,
                      const int32_t* __restrict__ counts /*[E]*/, int num_tokens, int num_experts,
                      int top_k, int num_chunks, float aux_coef, float z_coef) {
  __shared__ float red[kAuxFinishThreads];
  const int tid = threadIdx.x;
  const float tokens = float(num_tokens), experts = float(num_experts), k = float(top_k);
  float balance = 0;
  for (int e = tid; e < num_experts; e += kAuxFinishThreads) {
    float col = 0;
#pragma unroll 8
    for (int c = 0; c < num_chunks; ++c) col += col_partial[int64_t(c) * num_experts + e];
    const float cnt = float(counts[e]);
    balance += cnt * (col / tokens);
    aux_grad[e] = aux_coef * experts * cnt / (tokens * tokens * k);
  }
  red[tid] = balance;
  __syncthreads();
  for (int stride = kAuxFinishThreads / 2; stride > 0; stride >>= 1) {
    if (tid < stride) red[tid] += red[tid + stride];
    __syncthreads();
  }
  if (tid == 0) {
    float z = 0;
    for (int c = 0; c < num_chunks; ++c) z += z_partial[c];
    z /= tokens;
    const float aux = experts / (tokens * k) * red[0];
    losses[0] = __fadd_rn(losses[0], __fmul_rn(aux_coef, aux));
    losses[1] = __fadd_rn(losses[1], __fmul_rn(z_coef, z));
  }
}

struct AuxChunking {
  int rows_per_chunk = 0, num_chunks = 0;
};

AuxChunking aux_chunking(int num_tokens) {
  AuxChunking c;
  const int chunks = std::min(kAuxMaxChunks, ceil_div(num_tokens, kAuxMinRows));
  c.rows_per_chunk = ceil_div(num_tokens, chunks);
  c.num_chunks = ceil_div(num_tokens, c.rows_per_chunk);  // no empty trailing chunk
  return c;
}

template <int kPerLane>
void router_fwd_launch(int32_t* topk_idx, float* topk_w, float* probs, float* lse,
                       const float* logits, int num_tokens, int num_experts, int top_k,
                       bool renormalize, cudaStream_t stream) {
  const int blocks = ceil_div(num_tokens, kRouterWarps);
  router_fwd_kernel<kPerLane><<<blocks, kRouterWarps * kWarp, 0, stream>>>(
      topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k, renormalize);
}

template <int kPerLane>
void router_bwd_launch(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                       const int32_t* topk_idx, const float* topk_w, const float* aux_grad,
                       float z_grad_scale, int num_tokens, int num_experts, int top_k,
                       bool renormalize, cudaStream_t stream) {
  const int blocks = ceil_div(num_tokens, kRouterWarps);
  router_bwd_kernel<kPerLane><<<blocks, kRouterWarps * kWarp, 0, stream>>>(
      dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale, num_tokens,
      num_experts, top_k, renormalize);
}

void check_router_sizes(int num_tokens, int num_experts, int top_k) {
  MOP_CHECK(
      num_tokens >= 0 && top_k >= 1 && top_k <= num_experts && num_experts <= kRouterMaxExperts,
      "router: T = ", num_tokens, ", K = ", top_k, ", E = ", num_experts, " (need 1 ≤ K ≤ E ≤ ",
      kRouterMaxExperts, ")");
}

}  // namespace

void launch_router_fwd(int32_t* topk_idx, float* topk_w, float* probs, float* lse,
                       const float* logits, int num_tokens, int num_experts, int top_k,
                       bool renormalize, cudaStream_t stream) {
  check_router_sizes(num_tokens, num_experts, top_k);
  if (num_tokens == 0) return;
  MOP_CHECK(topk_idx && topk_w && probs && lse && logits, "router_fwd: null pointer");
  const int per_lane = ceil_div(num_experts, kWarp);
  if (per_lane <= 1)
    router_fwd_launch<1>(topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k,
                         renormalize, stream);
  else if (per_lane <= 2)
    router_fwd_launch<2>(topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k,
                         renormalize, stream);
  else if (per_lane <= 4)
    router_fwd_launch<4>(topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k,
                         renormalize, stream);
  else if (per_lane <= 8)
    router_fwd_launch<8>(topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k,
                         renormalize, stream);
  else if (per_lane <= 16)
    router_fwd_launch<16>(topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k,
                          renormalize, stream);
  else
    router_fwd_launch<32>(topk_idx, topk_w, probs, lse, logits, num_tokens, num_experts, top_k,
                          renormalize, stream);
  MOP_CUDA_CHECK_LAUNCH();
}

void launch_router_bwd(float* dlogits, const float* dtopk_w, const float* probs, const float* lse,
                       const int32_t* topk_idx, const float* topk_w, const float* aux_grad,
                       float z_grad_scale, int num_tokens, int num_experts, int top_k,
                       bool renormalize, cudaStream_t stream) {
  check_router_sizes(num_tokens, num_experts, top_k);
  if (num_tokens == 0) return;
  MOP_CHECK(dlogits && dtopk_w && probs && lse && topk_idx && topk_w && aux_grad,
            "router_bwd: null pointer");
  const int per_lane = ceil_div(num_experts, kWarp);
  if (per_lane <= 1)
    router_bwd_launch<1>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                         num_tokens, num_experts, top_k, renormalize, stream);
  else if (per_lane <= 2)
    router_bwd_launch<2>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                         num_tokens, num_experts, top_k, renormalize, stream);
  else if (per_lane <= 4)
    router_bwd_launch<4>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                         num_tokens, num_experts, top_k, renormalize, stream);
  else if (per_lane <= 8)
    router_bwd_launch<8>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                         num_tokens, num_experts, top_k, renormalize, stream);
  else if (per_lane <= 16)
    router_bwd_launch<16>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                          num_tokens, num_experts, top_k, renormalize, stream);
  else
    router_bwd_launch<32>(dlogits, dtopk_w, probs, lse, topk_idx, topk_w, aux_grad, z_grad_scale,
                          num_tokens, num_experts, top_k, renormalize, stream);
  MOP_CUDA_CHECK_LAUNCH();
}

size_t moe_aux_loss_workspace_bytes(int num_experts) {
  return size_t(kAuxMaxChunks) * size_t(num_experts + 1) * sizeof(float);
}

void launch_moe_aux_loss(float* losses, float* aux_grad, void* workspace, const float* probs,
                         const float* lse, const int32_t* counts, int num_tokens, int num_experts,
                         int top_k, float aux_coef, float z_coef, cudaStream_t stream) {
  MOP_CHECK(num_tokens > 0 && top_k >= 1 && top_k <= num_experts, "moe_aux_loss: T = ", num_tokens,
            ", K = ", top_k, ", E = ", num_experts);
  MOP_CHECK(losses && aux_grad && workspace && probs && lse && counts,
            "moe_aux_loss: null pointer");
  MOP_CHECK(reinterpret_cast<uintptr_t>(workspace) % 16 == 0, "moe_aux_loss: workspace alignment");
  const AuxChunking c = aux_chunking(num_tokens);
  // Layout: col_partial [kAuxMaxChunks, E] then z_partial [kAuxMaxChunks].
  float* col_partial = static_cast<float*>(workspace);
  float* z_partial = col_partial + size_t(kAuxMaxChunks) * size_t(num_experts);
  const dim3 grid(unsigned(ceil_div(num_experts, kAuxCols)), unsigned(c.num_chunks));
  aux_colsum_kernel<<<grid, dim3(kAuxCols, kAuxRows), 0, stream>>>(
      col_partial, z_partial, probs, lse, num_tokens, num_experts, c.rows_per_chunk);
  MOP_CUDA_CHECK_LAUNCH();
  aux_finish_kernel<<<1, kAuxFinishThreads, 0, stream>>>(losses, aux_grad, col_partial, z_partial,
                                                         counts, num_tokens, num_experts, top_k,
                                                         c.num_chunks, aux_coef, z_coef);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
