// Permutation kernels (permute.cuh).
// Route plan, three launches: (1) per-block expert histograms of 2048 assignments; (2) one block
// turns them into counts, offsets and every block's first row per expert (integer sums over the
// blocks in order); (3) each block re-counts per warp, then every warp walks its assignments in
// order, 32 at a time: __match_any_sync groups the lanes that share an expert and a lane's rank
// among its lower peers is its place. That is a stable counting sort — rows of an expert ordered
// by assignment index t·K+k, as the reference's sequential loop — with no atomics on the output.
// Row moves run one warp per output row, token or (token, k) pair, in 16-byte vectors when H % 8
// == 0 and the rows are 16-byte aligned, element by element otherwise.
#include "kernels/moe_permute.cuh"

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "runtime/cuda_check.h"
#include "core/error.h"

namespace mop::kernels {
namespace {

using bf = __nv_bfloat16;
static_assert(sizeof(bf) == sizeof(mop::bf16), "host bf16 must match __nv_bfloat16");

constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

// Route plan tiling: a 256-thread block owns kPlanTile consecutive assignments; warp w of it owns
// the kPlanWarpItems starting at w·kPlanWarpItems, taken kPlanGroups times 32 at a time.
constexpr int kPlanThreads = 256;
constexpr int kPlanWarps = kPlanThreads / kWarp;
constexpr int kPlanGroups = 8;
constexpr int kPlanWarpItems = kPlanGroups * kWarp;
constexpr int kPlanTile = kPlanWarps * kPlanWarpItems;  // 2048
constexpr int kPlanScanThreads = 1024;

// Row moves: rows (tokens, pairs) per 256-thread block.
constexpr int kRowWarps = 8;
constexpr int kRowThreads = kRowWarps * kWarp;

int ceil_div(int a, int b) {
  return (a + b - 1) / b;
}

// ---- route plan -------------------------------------------------------------------------------

__global__ void __launch_bounds__(kPlanThreads)
    plan_histogram_kernel(int32_t* __restrict__ block_hist /*[B,E]*/,
                          const int32_t* __restrict__ topk_idx /*[n]*/, int n, int num_experts) {
  extern __shared__ int32_t hist[];  // [E]
  for (int e = threadIdx.x; e < num_experts; e += kPlanThreads) hist[e] = 0;
  __syncthreads();
  const int64_t base = int64_t(blockIdx.x) * kPlanTile;
  for (int i = threadIdx.x; i < kPlanTile; i += kPlanThreads) {
    const int64_t a = base + i;
    if (a < n) {
      const int e = topk_idx[a];
      if (e >= 0 && e < num_experts) atomicAdd(&hist[e], 1);  // integer: order-free
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += kPlanThreads)
    block_hist[int64_t(blockIdx.x) * num_experts + e] = hist[e];
}

// One block. Thread (s, e) = (tid / E, tid % E) owns expert e over the segment s of seg_len
// blocks; warp 0 forms counts and their exclusive scan; then each thread rewrites its segment's
// histograms in place into first rows: block_hist[b,e] ← offsets[e] + Σ_{b'<b} hist[b',e].
__global__ void __launch_bounds__(kPlanScanThreads)
    plan_scan_kernel(int32_t* __restrict__ counts /*[E]*/, int32_t* __restrict__ offsets /*[E+1]*/,
                     int32_t* __restrict__ block_hist /*[B,E]*/, int num_blocks, int num_experts,
                     int num_segs, int seg_len) {
  extern __shared__ int32_t scan_smem[];
  int32_t* seg_sum = scan_smem;                         // [segs, E]
  int32_t* first = scan_smem + num_segs * num_experts;  // [E]
  const int tid = threadIdx.x;
  const bool active = tid < num_segs * num_experts;
  const int s = tid / num_experts, e = tid % num_experts;
  const int b0 = s * seg_len, b1 = min(num_blocks, b0 + seg_len);
  if (active) {
    int sum = 0;
    for (int b = b0; b < b1; ++b) sum += block_hist[int64_t(b) * num_experts + e];
    seg_sum[tid] = sum;
  }
  __syncthreads();
  if (tid < kWarp) {
    int carry = 0;
    for (int e0 = 0; e0 < num_experts; e0 += kWarp) {
      const int ee = e0 + tid;
      int c = 0;
      if (ee < num_experts)
        for (int ss = 0; ss < num_segs; ++ss) c += seg_sum[ss * num_experts + ee];
      int incl = c;
#pragma unroll
      for (int d = 1; d < kWarp; d <<= 1) {
        const int o = __shfl_up_sync(kFullMask, incl, d);
        if (tid >= d) incl += o;
      }
      if (ee < num_experts) {
        counts[ee] = c;
        offsets[ee] = carry + incl - c;
        first[ee] = carry + incl - c;
      }
      carry += __shfl_sync(kFullMask, incl, kWarp - 1);
    }
    if (tid == 0) offsets[num_experts] = carry;
  }
  __syncthreads();
  if (active) {
    int run = first[e];
    for (int ss = 0; ss < s; ++ss) run += seg_sum[ss * num_experts + e];
    for (int b = b0; b < b1; ++b) {
      const int64_t i = int64_t(b) * num_experts + e;
      const int h = block_hist[i];
      block_hist[i] = run;
      run += h;
    }
  }
}

__global__ void __launch_bounds__(kPlanThreads)
    plan_scatter_kernel(int32_t* __restrict__ perm_src /*[n]*/,
                        int32_t* __restrict__ slot_of /*[n]*/,
                        const int32_t* __restrict__ block_first /*[B,E]*/,
                        const int32_t* __restrict__ topk_idx /*[n]*/, int n, int top_k,
                        int num_experts) {
  extern __shared__ int32_t warp_next[];  // [kPlanWarps, E]: a warp's next free row per expert
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  for (int i = threadIdx.x; i < kPlanWarps * num_experts; i += kPlanThreads) warp_next[i] = 0;
  __syncthreads();
  const int64_t base = int64_t(blockIdx.x) * kPlanTile + warp * kPlanWarpItems + lane;
  int key[kPlanGroups];  // the expert of each of this lane's assignments, -1 when none
#pragma unroll
  for (int g = 0; g < kPlanGroups; ++g) {
    const int64_t a = base + g * kWarp;
    const int e = a < n ? topk_idx[a] : -1;
    key[g] = (e >= 0 && e < num_experts) ? e : -1;
    if (key[g] >= 0) atomicAdd(&warp_next[warp * num_experts + key[g]], 1);
  }
  __syncthreads();
  // Per-warp counts → each warp's first row: the block's first row plus the earlier warps' counts.
  for (int e = threadIdx.x; e < num_experts; e += kPlanThreads) {
    int run = block_first[int64_t(blockIdx.x) * num_experts + e];
    for (int w = 0; w < kPlanWarps; ++w) {
      const int c = warp_next[w * num_experts + e];
      warp_next[w * num_experts + e] = run;
      run += c;
    }
  }
  __syncthreads();
  int32_t* next = warp_next + warp * num_experts;
  const unsigned lower = (1u << lane) - 1u;
#pragma unroll
  for (int g = 0; g < kPlanGroups; ++g) {
    const int e = key[g];
    const unsigned peers = __match_any_sync(kFullMask, e);
    const int64_t a = base + g * kWarp;
    if (e >= 0) {
      const int row = next[e] + __popc(peers & lower);
      perm_src[row] = int32_t(a / top_k);
      slot_of[a] = row;
    }
    __syncwarp();  // every lane has read next[e] before its group's leader advances it
    if (e >= 0 && lane == __ffs(peers) - 1) next[e] += __popc(peers);
    __syncwarp();
  }
}

// ---- bf16 rows ----------------------------------------------------------------------------------

template <int kVec>
__device__ __forceinline__ void load_f32(const bf* p, float (&f)[kVec]) {
  if constexpr (kVec == 8) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const __nv_bfloat162* h = reinterpret_cast<const __nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) {
      const float2 v = __bfloat1622float2(h[j]);
      f[2 * j] = v.x;
      f[2 * j + 1] = v.y;
    }
  } else {
    static_assert(kVec == 1);
    f[0] = __bfloat162float(*p);
  }
}

template <int kVec>
__device__ __forceinline__ void store_bf16(bf* p, const float (&f)[kVec]) {
  if constexpr (kVec == 8) {
    uint4 u;
    __nv_bfloat162* h = reinterpret_cast<__nv_bfloat162*>(&u);
#pragma unroll
    for (int j = 0; j < 4; ++j) h[j] = __floats2bfloat162_rn(f[2 * j], f[2 * j + 1]);
    *reinterpret_cast<uint4*>(p) = u;
  } else {
    static_assert(kVec == 1);
    *p = __float2bfloat16_rn(f[0]);
  }
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int m = kWarp / 2; m > 0; m >>= 1) v += __shfl_xor_sync(kFullMask, v, m);
  return v;
}

template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    permute_fwd_kernel(bf* __restrict__ xp /*[R,H]*/, const bf* __restrict__ x /*[T,H]*/,
                       const int32_t* __restrict__ perm_src /*[R]*/, int64_t rows, int hidden) {
  using Raw = std::conditional_t<kVec == 8, uint4, unsigned short>;
  const int lane = threadIdx.x % kWarp;
  const int64_t r = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (r >= rows) return;
  const Raw* from = reinterpret_cast<const Raw*>(x + int64_t(perm_src[r]) * hidden);
  Raw* to = reinterpret_cast<Raw*>(xp + r * hidden);
  const int chunks = hidden / kVec;
#pragma unroll 4
  for (int c = lane; c < chunks; c += kWarp) to[c] = from[c];
}

// One warp per token; its K slots staged in shared memory; fp32 sums in k order, rounded once.
template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    permute_bwd_kernel(bf* __restrict__ dx /*[T,H]*/, const bf* __restrict__ dxp /*[T·K,H]*/,
                       const int32_t* __restrict__ slot_of /*[T·K]*/, int num_tokens, int top_k,
                       int hidden, bool accumulate) {
  extern __shared__ int32_t bwd_slots[];  // [kRowWarps, K]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t t = int64_t(blockIdx.x) * kRowWarps + warp;
  if (t >= num_tokens) return;  // whole warps leave; only warp barriers follow
  int32_t* slots = bwd_slots + warp * top_k;
  for (int k = lane; k < top_k; k += kWarp) slots[k] = slot_of[t * top_k + k];
  __syncwarp();
  bf* out = dx + t * hidden;
  const int chunks = hidden / kVec;
  for (int c = lane; c < chunks; c += kWarp) {
    float acc[kVec];
    if (accumulate) {
      load_f32<kVec>(out + c * kVec, acc);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
    }
#pragma unroll 4
    for (int k = 0; k < top_k; ++k) {
      float v[kVec];
      load_f32<kVec>(dxp + int64_t(slots[k]) * hidden + c * kVec, v);
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] += v[j];
    }
    store_bf16<kVec>(out + c * kVec, acc);
  }
}

// As permute_bwd, each term weighted: acc += w_k·v (rounded product, then sum: no FMA, like the
// reference's out += wk * src).
template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_fwd_kernel(bf* __restrict__ y /*[T,H]*/, const bf* __restrict__ yp /*[T·K,H]*/,
                         const int32_t* __restrict__ slot_of /*[T·K]*/,
                         const float* __restrict__ topk_w /*[T,K]*/, int num_tokens, int top_k,
                         int hidden, bool accumulate) {
  extern __shared__ int32_t fwd_stage[];  // slots [kRowWarps, K], then weights [kRowWarps, K]
  const int warp = threadIdx.x / kWarp, lane = threadIdx.x % kWarp;
  const int64_t t = int64_t(blockIdx.x) * kRowWarps + warp;
  if (t >= num_tokens) return;
  int32_t* slots = fwd_stage + warp * top_k;
  float* weights = reinterpret_cast<float*>(fwd_stage + kRowWarps * top_k) + warp * top_k;
  for (int k = lane; k < top_k; k += kWarp) {
    slots[k] = slot_of[t * top_k + k];
    weights[k] = topk_w[t * top_k + k];
  }
  __syncwarp();
  bf* out = y + t * hidden;
  const int chunks = hidden / kVec;
  for (int c = lane; c < chunks; c += kWarp) {
    float acc[kVec];
    if (accumulate) {
      load_f32<kVec>(out + c * kVec, acc);
    } else {
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = 0.f;
    }
#pragma unroll 4
    for (int k = 0; k < top_k; ++k) {
      float v[kVec];
      load_f32<kVec>(yp + int64_t(slots[k]) * hidden + c * kVec, v);
      const float w = weights[k];
#pragma unroll
      for (int j = 0; j < kVec; ++j) acc[j] = __fadd_rn(acc[j], __fmul_rn(w, v[j]));
    }
    store_bf16<kVec>(out + c * kVec, acc);
  }
}

// One warp per (token, k) pair: the scaled copy of dy[t] into its row, and the dot product
// ⟨dy[t], yp[row]⟩ in fp32 — lane partials in chunk order, then a butterfly: deterministic.
template <int kVec>
__global__ void __launch_bounds__(kRowThreads)
    unpermute_bwd_kernel(bf* __restrict__ dyp /*[T·K,H]*/, float* __restrict__ dtopk_w /*[T·K]*/,
                         const bf* __restrict__ dy /*[T,H]*/, const bf* __restrict__ yp,
                         const int32_t* __restrict__ slot_of, const float* __restrict__ topk_w,
                         int64_t pairs, int top_k, int hidden) {
  const int lane = threadIdx.x % kWarp;
  const int64_t pr = int64_t(blockIdx.x) * kRowWarps + threadIdx.x / kWarp;
  if (pr >= pairs) return;
  const int64_t t = pr / top_k, row = slot_of[pr];
  const float w = topk_w[pr];
  const bf* d = dy + t * hidden;
  const bf* src = yp + row * hidden;
  bf* out = dyp + row * hidden;
  const int chunks = hidden / kVec;
  float dot = 0;
#pragma unroll 2
  for (int c = lane; c < chunks; c += kWarp) {
    float dv[kVec], yv[kVec], o[kVec];
    load_f32<kVec>(d + c * kVec, dv);
    load_f32<kVec>(src + c * kVec, yv);
#pragma unroll
    for (int j = 0; j < kVec; ++j) {
      dot += dv[j] * yv[j];
      o[j] = w * dv[j];
    }
    store_bf16<kVec>(out + c * kVec, o);
  }
  dot = warp_sum(dot);
  if (lane == 0) dtopk_w[pr] = dot;
}

// 16-byte vectors need H % 8 == 0 and 16-byte aligned bases (rows are then aligned too).
bool vec8_ok(int hidden, std::initializer_list<const void*> ptrs) {
  if (hidden % 8 != 0) return false;
  for (const void* p : ptrs)
    if (reinterpret_cast<uintptr_t>(p) % 16 != 0) return false;
  return true;
}

unsigned row_blocks(int64_t rows) {
  const int64_t blocks = (rows + kRowWarps - 1) / kRowWarps;
  MOP_CHECK(blocks <= INT_MAX, "moe permutation: ", rows, " rows exceed one grid");
  return unsigned(blocks);
}

void check_rows(int num_tokens, int top_k, int hidden, const char* op) {
  MOP_CHECK(num_tokens >= 0 && top_k >= 1 && top_k <= kPermuteMaxTopK && hidden >= 0, op,
            ": T = ", num_tokens, ", K = ", top_k, " (at most ", kPermuteMaxTopK,
            "), H = ", hidden);
}

}  // namespace

size_t route_plan_workspace_bytes(int64_t num_assignments, int num_experts) {
  const int64_t blocks = (num_assignments + kPlanTile - 1) / kPlanTile;
  return size_t(blocks) * size_t(num_experts) * sizeof(int32_t);
}

void launch_moe_route_plan(int32_t* counts, int32_t* offsets, int32_t* perm_src, int32_t* slot_of,
                           void* workspace, const int32_t* topk_idx, int num_tokens, int top_k,
                           int num_experts, cudaStream_t stream) {
  MOP_CHECK(num_tokens >= 0 && top_k >= 1 && num_experts >= 1 && num_experts <= kPlanMaxExperts,
            "moe_route_plan: T = ", num_tokens, ", K = ", top_k, ", E = ", num_experts,
            " (E at most ", kPlanMaxExperts, ")");
  const int64_t n = int64_t(num_tokens) * top_k;
  MOP_CHECK(n <= INT_MAX - kPlanTile, "moe_route_plan: ", n, " assignments exceed int32 rows");
  const int blocks = int((n + kPlanTile - 1) / kPlanTile);
  MOP_CHECK(counts && offsets && (n == 0 || (perm_src && slot_of && workspace && topk_idx)),
            "moe_route_plan: null pointer");
  int32_t* block_hist = static_cast<int32_t*>(workspace);
  const size_t expert_ints = size_t(num_experts) * sizeof(int32_t);
  if (blocks > 0) {
    plan_histogram_kernel<<<blocks, kPlanThreads, expert_ints, stream>>>(block_hist, topk_idx,
                                                                         int(n), num_experts);
    MOP_CUDA_CHECK_LAUNCH();
  }
  // Segments split the block range so that segs·E ≤ 1024 threads share the scan.
  const int segs = std::max(1, std::min(kPlanScanThreads / num_experts, blocks));
  const int seg_len = blocks == 0 ? 0 : ceil_div(blocks, segs);
  const size_t scan_smem = size_t(segs + 1) * expert_ints;
  plan_scan_kernel<<<1, kPlanScanThreads, scan_smem, stream>>>(counts, offsets, block_hist, blocks,
                                                               num_experts, segs, seg_len);
  MOP_CUDA_CHECK_LAUNCH();
  if (blocks > 0) {
    plan_scatter_kernel<<<blocks, kPlanThreads, kPlanWarps * expert_ints, stream>>>(
        perm_src, slot_of, block_hist, topk_idx, int(n), top_k, num_experts);
    MOP_CUDA_CHECK_LAUNCH();
  }
}

void launch_moe_permute_fwd(bf16* xp, const bf16* x, const int32_t* perm_src, int64_t rows,
                            int hidden, cudaStream_t stream) {
  MOP_CHECK(rows >= 0 && hidden >= 0, "moe_permute_fwd: R = ", rows, ", H = ", hidden);
  if (rows == 0 || hidden == 0) return;
  MOP_CHECK(xp && x && perm_src, "moe_permute_fwd: null pointer");
  bf* out = reinterpret_cast<bf*>(xp);
  const bf* in = reinterpret_cast<const bf*>(x);
  if (vec8_ok(hidden, {xp, x}))
    permute_fwd_kernel<8>
        <<<row_blocks(rows), kRowThreads, 0, stream>>>(out, in, perm_src, rows, hidden);
  else
    permute_fwd_kernel<1>
        <<<row_blocks(rows), kRowThreads, 0, stream>>>(out, in, perm_src, rows, hidden);
  MOP_CUDA_CHECK_LAUNCH();
}

void launch_moe_permute_bwd(bf16* dx, const bf16* dxp, const int32_t* slot_of, int num_tokens,
                            int top_k, int hidden, bool accumulate, cudaStream_t stream) {
  check_rows(num_tokens, top_k, hidden, "moe_permute_bwd");
  if (num_tokens == 0 || hidden == 0) return;
  MOP_CHECK(dx && dxp && slot_of, "moe_permute_bwd: null pointer");
  bf* out = reinterpret_cast<bf*>(dx);
  const bf* in = reinterpret_cast<const bf*>(dxp);
  const size_t smem = size_t(kRowWarps) * top_k * sizeof(int32_t);
  const unsigned blocks = row_blocks(num_tokens);
  if (vec8_ok(hidden, {dx, dxp}))
    permute_bwd_kernel<8><<<blocks, kRowThreads, smem, stream>>>(out, in, slot_of, num_tokens,
                                                                 top_k, hidden, accumulate);
  else
    permute_bwd_kernel<1><<<blocks, kRowThreads, smem, stream>>>(out, in, slot_of, num_tokens,
                                                                 top_k, hidden, accumulate);
  MOP_CUDA_CHECK_LAUNCH();
}

void launch_moe_unpermute_fwd(bf16* y, const bf16* yp, const int32_t* slot_of, const float* topk_w,
                              int num_tokens, int top_k, int hidden, bool accumulate,
                              cudaStream_t stream) {
  check_rows(num_tokens, top_k, hidden, "moe_unpermute_fwd");
  if (num_tokens == 0 || hidden == 0) return;
  MOP_CHECK(y && yp && slot_of && topk_w, "moe_unpermute_fwd: null pointer");
  bf* out = reinterpret_cast<bf*>(y);
  const bf* in = reinterpret_cast<const bf*>(yp);
  const size_t smem = size_t(kRowWarps) * top_k * (sizeof(int32_t) + sizeof(float));
  const unsigned blocks = row_blocks(num_tokens);
  if (vec8_ok(hidden, {y, yp}))
    unpermute_fwd_kernel<8><<<blocks, kRowThreads, smem, stream>>>(
        out, in, slot_of, topk_w, num_tokens, top_k, hidden, accumulate);
  else
    unpermute_fwd_kernel<1><<<blocks, kRowThreads, smem, stream>>>(
        out, in, slot_of, topk_w, num_tokens, top_k, hidden, accumulate);
  MOP_CUDA_CHECK_LAUNCH();
}

void launch_moe_unpermute_bwd(bf16* dyp, float* dtopk_w, const bf16* dy, const bf16* yp,
                              const int32_t* slot_of, const float* topk_w, int num_tokens,
                              int top_k, int hidden, cudaStream_t stream) {
  MOP_CHECK(num_tokens >= 0 && top_k >= 1 && hidden >= 0, "moe_unpermute_bwd: T = ", num_tokens,
            ", K = ", top_k, ", H = ", hidden);
  const int64_t pairs = int64_t(num_tokens) * top_k;
  if (pairs == 0) return;
  MOP_CHECK(dtopk_w && slot_of && topk_w && (hidden == 0 || (dyp && dy && yp)),
            "moe_unpermute_bwd: null pointer");
  bf* out = reinterpret_cast<bf*>(dyp);
  const bf* d = reinterpret_cast<const bf*>(dy);
  const bf* src = reinterpret_cast<const bf*>(yp);
  const unsigned blocks = row_blocks(pairs);
  // H = 0 still writes dtopk_w = 0 (an empty dot product).
  if (vec8_ok(hidden, {dyp, dy, yp}))
    unpermute_bwd_kernel<8><<<blocks, kRowThreads, 0, stream>>>(out, dtopk_w, d, src, slot_of,
                                                                topk_w, pairs, top_k, hidden);
  else
    unpermute_bwd_kernel<1><<<blocks, kRowThreads, 0, stream>>>(out, dtopk_w, d, src, slot_of,
                                                                topk_w, pairs, top_k, hidden);
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
