// Embedding forward (one warp per token row, 16-byte vectors) and backward.
// Backward: (1) CUB radix-sorts (id, token) pairs by id — stable, so tokens of one id stay in
// token order; (2) a warp per sorted position: the one at the start of a run of ≤ kShortRun tokens
// (nearly all of them) sums it, starting from the table row and adding token rows in token order —
// the reference's order, so those rows match it bit for bit — and lists longer runs; (3) a long
// run (a frequent token) gets a block per column slice, which finds the run's end with a 32-way
// search and splits its tokens over kLongWarps warps whose sums are added to the row in warp
// order.
// No floating-point atomics: every table row is written by exactly one warp or block, so results
// are reproducible.
#include <algorithm>
#include <cub/device/device_radix_sort.cuh>

#include "runtime/cuda_check.h"
#include "kernels/elementwise.cuh"
#include "kernels/embedding.cuh"

namespace mop::kernels {
namespace {

using namespace detail;
using bf16_t = __nv_bfloat16;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / kWarpSize;
// Runs this long or shorter are summed by one warp (their token indices fit one load per lane).
constexpr int kShortRun = 16;
static_assert(kShortRun < kWarpSize);
// 8-wide vectors per lane per pass over a short run's columns, and tokens whose rows are loaded
// together (kShortRun is a multiple, so batch indices stay below 32).
constexpr int kShortVecs = 2;
constexpr int kShortBatch = 4;
static_assert(kShortRun % kShortBatch == 0);
// Long runs: warps per block and rows each warp loads at once (a frequent token's hundreds of
// rows, kLongWarps · kLongBatch in flight), and at most kLongBlocks blocks per column slice, each
// looping over the listed runs (few: at most one id in 17 tokens has a long run).
constexpr int kLongWarps = 16;
constexpr int kLongThreads = kLongWarps * kWarpSize;
constexpr unsigned kLongBlocks = 64;
constexpr int kLongBatch = 8;  // tokens whose rows a warp loads together

// First sorted position after i whose id differs from key, or n. Called by all 32 lanes of a warp
// with the same arguments. Invariant: ids[lo − 1] == key and the answer lies in [lo, hi]; each
// step probes 32 evenly spaced positions and keeps the gap before the first differing one, so a
// run of length L costs about ⌈log32 L⌉ + 1 dependent loads.
__device__ int run_end(const uint32_t* __restrict__ ids, int i, int n, uint32_t key) {
  const int lane = int(threadIdx.x) % kWarpSize;
  int lo = i + 1, hi = n;
  while (lo < hi) {
    const int step = (hi - lo + kWarpSize - 1) / kWarpSize;
    const int p = lo + lane * step;
    const bool differs = p >= hi || ids[p] != key;
    const unsigned ballot = __ballot_sync(kFullMask, differs);
    if (ballot == 0) {
      lo += (kWarpSize - 1) * step + 1;  // all 32 probes (all < hi) still hold key
    } else {
      const int f = __ffs(int(ballot)) - 1;
      hi = min(hi, lo + f * step);
      if (f > 0) lo += (f - 1) * step + 1;
    }
  }
  return lo;
}

template <int kVec>
__global__ void __launch_bounds__(kThreads)
    embedding_fwd_kernel(bf16_t* __restrict__ out, const int32_t* __restrict__ ids,
                         const bf16_t* __restrict__ table, int64_t tokens, int64_t vocab,
                         int64_t hidden, volatile int* error_flag) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int64_t num_warps = int64_t(gridDim.x) * kWarps;
  const int64_t num_vec = hidden / kVec;
  // bf16 rows are copied as bit patterns.
  const uint16_t* src_bits = reinterpret_cast<const uint16_t*>(table);
  uint16_t* dst_bits = reinterpret_cast<uint16_t*>(out);
  for (int64_t t = int64_t(blockIdx.x) * kWarps + threadIdx.x / kWarpSize; t < tokens;
       t += num_warps) {
    const int32_t id = ids[t];
    const bool ok = id >= 0 && id < vocab;
    if (!ok && lane == 0) *error_flag = 1;
    const int64_t src = (ok ? int64_t(id) : 0) * hidden, dst = t * hidden;
    for (int64_t v = lane; v < num_vec; v += kWarpSize) {
      if constexpr (kVec == 8)
        store_bf16x8(out + dst + v * 8,
                     ok ? load_bf16x8(table + src + v * 8) : make_uint4(0, 0, 0, 0));
      else
        dst_bits[dst + v] = ok ? src_bits[src + v] : uint16_t(0);
    }
  }
}

// kVec fp32 values of a table row ↔ registers (kVec = 8: two 16-byte accesses).
template <int kVec>
__device__ __forceinline__ void load_row_part(const float* p, float (&f)[kVec]) {
  const Packed<float, kVec> r = load_packed<float, kVec>(p);
#pragma unroll
  for (int e = 0; e < kVec; ++e) f[e] = r.v[e];
}
template <int kVec>
__device__ __forceinline__ void store_row_part(float* p, const float (&f)[kVec]) {
  Packed<float, kVec> r;
#pragma unroll
  for (int e = 0; e < kVec; ++e) r.v[e] = f[e];
  store_packed(p, r);
}
// kVec bf16 values as raw bits (one 16-byte load for kVec = 8), and adding them to fp32 sums.
template <int kVec>
using RawBf16 = Packed<uint16_t, kVec>;
template <int kVec>
__device__ __forceinline__ RawBf16<kVec> load_raw(const bf16_t* p) {
  return load_packed<uint16_t, kVec>(reinterpret_cast<const uint16_t*>(p));
}
template <int kVec>
__device__ __forceinline__ void add_raw(float (&acc)[kVec], const RawBf16<kVec>& r) {
#pragma unroll
  for (int e = 0; e < kVec; ++e) acc[e] += bf16_bits_to_float(r.v[e]);
}

// One warp per sorted position. The warp at the start of a run reads the next 31 sorted ids at
// once to find the run's length: a short run it sums; a long one it appends to long_runs for
// embedding_bwd_long_kernel (an integer atomic: the list's order varies from run to run, but every
// long run is then summed by its own blocks in a fixed order, so the results do not).
template <int kVec>
__global__ void __launch_bounds__(kThreads)
    embedding_bwd_short_kernel(float* __restrict__ dtable, const uint32_t* __restrict__ sorted_ids,
                               const int32_t* __restrict__ sorted_tokens,
                               const bf16_t* __restrict__ dout, int tokens, uint32_t vocab,
                               int64_t hidden, int32_t* __restrict__ long_runs,
                               volatile int* error_flag) {
  const int lane = int(threadIdx.x) % kWarpSize;
  const int i = int(blockIdx.x) * kWarps + int(threadIdx.x) / kWarpSize;
  if (i >= tokens) return;  // whole warps leave together from here on
  const uint32_t key = sorted_ids[i];
  if (i > 0 && sorted_ids[i - 1] == key) return;
  const int p = i + lane;
  const bool differs = lane > 0 && (p >= tokens || sorted_ids[p] != key);
  const unsigned ballot = __ballot_sync(kFullMask, differs);
  const int len = ballot ? __ffs(int(ballot)) - 1 : kWarpSize;  // kWarpSize: at least that long
  if (len > kShortRun) {
    if (lane == 0) long_runs[1 + atomicAdd(long_runs, 1)] = i;
    return;
  }
  if (key >= vocab) {  // negative ids sort here too, as large unsigned keys
    if (lane == 0) *error_flag = 1;
    return;
  }
  const int my_token = lane < len ? sorted_tokens[i + lane] : 0;
  float* row = dtable + int64_t(key) * hidden;
  const int64_t num_vec = hidden / kVec;
  for (int64_t v0 = 0; v0 < num_vec; v0 += kWarpSize * kShortVecs) {
    float acc[kShortVecs][kVec];
#pragma unroll
    for (int k = 0; k < kShortVecs; ++k) {
      const int64_t v = v0 + k * kWarpSize + lane;
      if (v < num_vec) load_row_part<kVec>(row + v * kVec, acc[k]);
    }
    // Tokens in batches: all of a batch's row loads are issued before its adds, which then run
    // in token order.
    for (int j0 = 0; j0 < len; j0 += kShortBatch) {
      RawBf16<kVec> rows[kShortBatch][kShortVecs];
#pragma unroll
      for (int u = 0; u < kShortBatch; ++u) {
        const int64_t src = int64_t(__shfl_sync(kFullMask, my_token, j0 + u)) * hidden;
#pragma unroll
        for (int k = 0; k < kShortVecs; ++k) {
          const int64_t v = v0 + k * kWarpSize + lane;
          rows[u][k] = RawBf16<kVec>{};
          if (j0 + u < len && v < num_vec) rows[u][k] = load_raw<kVec>(dout + src + v * kVec);
        }
      }
#pragma unroll
      for (int u = 0; u < kShortBatch; ++u)
#pragma unroll
        for (int k = 0; k < kShortVecs; ++k)
          if (j0 + u < len) add_raw<kVec>(acc[k], rows[u][k]);
    }
#pragma unroll
    for (int k = 0; k < kShortVecs; ++k) {
      const int64_t v = v0 + k * kWarpSize + lane;
      if (v < num_vec) store_row_part<kVec>(row + v * kVec, acc[k]);
    }
  }
}

// Long runs: a block of kLongWarps warps per (listed run, slice of 32·kVec columns), looping over
// the listed runs (the grid need not know their number). Warp w takes the run's chunks of 32
// consecutive tokens w, w + kLongWarps, …: the lanes load a chunk's token indices at once, so the
// row loads of a chunk are independent and overlap. The warp sums are then added to the row in
// warp order. A run's result depends only on this fixed split, not on which block takes it.
template <int kVec>
__global__ void __launch_bounds__(kLongThreads)
    embedding_bwd_long_kernel(float* __restrict__ dtable, const uint32_t* __restrict__ sorted_ids,
                              const int32_t* __restrict__ sorted_tokens,
                              const bf16_t* __restrict__ dout, int tokens, uint32_t vocab,
                              int64_t hidden, const int32_t* __restrict__ long_runs,
                              volatile int* error_flag) {
  constexpr int kSlice = kWarpSize * kVec;
  __shared__ int run_stop;
  __shared__ float warp_sums[kLongWarps][kSlice];
  const int warp = int(threadIdx.x) / kWarpSize, lane = int(threadIdx.x) % kWarpSize;
  const int64_t c0 = int64_t(blockIdx.y) * kSlice;
  const int64_t c = c0 + lane * kVec;
  const bool active = c < hidden;  // hidden % kVec == 0, so the whole vector is inside
  const int num_long = long_runs[0];
  for (int r = int(blockIdx.x); r < num_long; r += int(gridDim.x)) {
    const int i = long_runs[1 + r];
    const uint32_t key = sorted_ids[i];
    if (key >= vocab) {  // the same for the whole block
      if (threadIdx.x == 0 && blockIdx.y == 0) *error_flag = 1;
      continue;
    }
    __syncthreads();  // the previous run's reads of run_stop and warp_sums are done
    if (warp == 0) {
      const int stop = run_end(sorted_ids, i, tokens, key);
      if (lane == 0) run_stop = stop;
    }
    __syncthreads();
    const int end = run_stop;
    float acc[kVec];
#pragma unroll
    for (int e = 0; e < kVec; ++e) acc[e] = 0;
    for (int j0 = i + warp * kWarpSize; j0 < end; j0 += kLongWarps * kWarpSize) {
      const int count = min(kWarpSize, end - j0);
      const int my_token = lane < count ? sorted_tokens[j0 + lane] : 0;
      for (int k0 = 0; k0 < count; k0 += kLongBatch) {  // loads of a batch, then its adds in order
        RawBf16<kVec> rows[kLongBatch];
#pragma unroll
        for (int u = 0; u < kLongBatch; ++u) {
          const int64_t src =
              int64_t(__shfl_sync(kFullMask, my_token, (k0 + u) % kWarpSize)) * hidden;
          rows[u] = RawBf16<kVec>{};
          if (active && k0 + u < count) rows[u] = load_raw<kVec>(dout + src + c);
        }
#pragma unroll
        for (int u = 0; u < kLongBatch; ++u)
          if (k0 + u < count) add_raw<kVec>(acc, rows[u]);
      }
    }
#pragma unroll
    for (int e = 0; e < kVec; ++e) warp_sums[warp][lane * kVec + e] = acc[e];
    __syncthreads();
    float* row = dtable + int64_t(key) * hidden;
    for (int s = int(threadIdx.x); s < kSlice; s += kLongThreads) {
      if (c0 + s >= hidden) break;
      float total = row[c0 + s];
      for (int w = 0; w < kLongWarps; ++w) total += warp_sums[w][s];
      row[c0 + s] = total;
    }
  }
}

__global__ void iota_kernel(int32_t* x, int64_t n) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  for (int64_t i = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; i < n; i += stride)
    x[i] = int32_t(i);
}

}  // namespace

void embedding_fwd(bf16_t* out, const int32_t* ids, const bf16_t* table, int64_t tokens,
                   int64_t vocab, int64_t hidden, int* error_flag, cudaStream_t stream) {
  MOP_CHECK(tokens >= 0 && vocab >= 0 && hidden >= 0, "embedding_fwd: ", tokens, " tokens, table [",
            vocab, ",", hidden, "]");
  if (tokens == 0 || hidden == 0) return;
  MOP_CHECK(out && ids && table && error_flag, "embedding_fwd: null pointer");
  const unsigned blocks = grid_for(tokens, kWarps);
  if (hidden % 8 == 0 && aligned_to(out, 16) && aligned_to(table, 16))
    embedding_fwd_kernel<8>
        <<<blocks, kThreads, 0, stream>>>(out, ids, table, tokens, vocab, hidden, error_flag);
  else
    embedding_fwd_kernel<1>
        <<<blocks, kThreads, 0, stream>>>(out, ids, table, tokens, vocab, hidden, error_flag);
  MOP_CUDA_CHECK_LAUNCH();
}

int64_t embedding_bwd_long_runs_size(int64_t tokens) {
  return 1 + tokens / (kShortRun + 1);
}

size_t embedding_bwd_sort_bytes(int64_t tokens) {
  MOP_CHECK(tokens >= 0 && tokens < (int64_t(1) << 31), "embedding_bwd: ", tokens, " tokens");
  size_t bytes = 0;
  // A size query: no work is queued.
  MOP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      nullptr, bytes, static_cast<const uint32_t*>(nullptr), static_cast<uint32_t*>(nullptr),
      static_cast<const int32_t*>(nullptr), static_cast<int32_t*>(nullptr), int(tokens)));
  return bytes;
}

void embedding_iota(int32_t* x, int64_t n, cudaStream_t stream) {
  if (n <= 0) return;
  iota_kernel<<<grid_for(n, kThreads), kThreads, 0, stream>>>(x, n);
  MOP_CUDA_CHECK_LAUNCH();
}

void embedding_bwd(float* dtable, const int32_t* ids, const bf16_t* dout, int64_t tokens,
                   int64_t vocab, int64_t hidden, const EmbeddingBwdWorkspace& ws, int* error_flag,
                   cudaStream_t stream) {
  MOP_CHECK(tokens >= 0 && vocab >= 0 && vocab < (int64_t(1) << 31) && hidden >= 0,
            "embedding_bwd: ", tokens, " tokens, table [", vocab, ",", hidden, "]");
  if (tokens == 0 || hidden == 0) return;
  MOP_CHECK(dtable && ids && dout && error_flag, "embedding_bwd: null pointer");
  MOP_CHECK(
      tokens <= ws.capacity && ws.sorted_ids && ws.sorted_tokens && ws.token_iota && ws.long_runs,
      "embedding_bwd: workspace for ", ws.capacity, " tokens, needs ", tokens);
  size_t sort_bytes = embedding_bwd_sort_bytes(tokens);
  MOP_CHECK(sort_bytes <= ws.sort_temp_bytes && ws.sort_temp, "embedding_bwd: sort storage of ",
            ws.sort_temp_bytes, " bytes, needs ", sort_bytes);
  sort_bytes = ws.sort_temp_bytes;
  const int n = int(tokens);
  // Keys are the ids as unsigned: all 32 bits, so a negative id sorts after every valid one and
  // is caught as ≥ vocab (a narrower bit range would save one of four passes on a ~10 µs sort).
  MOP_CUDA_CHECK(cub::DeviceRadixSort::SortPairs(
      ws.sort_temp, sort_bytes, reinterpret_cast<const uint32_t*>(ids), ws.sorted_ids,
      ws.token_iota, ws.sorted_tokens, n, 0, 32, stream));
  MOP_CUDA_CHECK(cudaMemsetAsync(ws.long_runs, 0, sizeof(int32_t), stream));  // no long runs yet
  const bool vec = hidden % 8 == 0 && aligned_to(dtable, 16) && aligned_to(dout, 16);
  const unsigned short_blocks = unsigned((tokens + kWarps - 1) / kWarps);
  const unsigned max_long_runs = unsigned(embedding_bwd_long_runs_size(tokens) - 1);
  const uint32_t v = uint32_t(vocab);
  auto launch = [&](auto vec_tag) {
    constexpr int kVec = decltype(vec_tag)::value;
    embedding_bwd_short_kernel<kVec><<<short_blocks, kThreads, 0, stream>>>(
        dtable, ws.sorted_ids, ws.sorted_tokens, dout, n, v, hidden, ws.long_runs, error_flag);
    MOP_CUDA_CHECK_LAUNCH();
    if (max_long_runs == 0) return;
    const int64_t slices = (hidden + kWarpSize * kVec - 1) / (kWarpSize * kVec);
    MOP_CHECK(slices <= 65535, "embedding_bwd: hidden ", hidden, " too large");
    const unsigned blocks = std::min(max_long_runs, kLongBlocks);
    embedding_bwd_long_kernel<kVec><<<dim3(blocks, unsigned(slices)), kLongThreads, 0, stream>>>(
        dtable, ws.sorted_ids, ws.sorted_tokens, dout, n, v, hidden, ws.long_runs, error_flag);
    MOP_CUDA_CHECK_LAUNCH();
  };
  if (vec)
    launch(std::integral_constant<int, 8>{});
  else
    launch(std::integral_constant<int, 1>{});
}

}  // namespace mop::kernels
