// CPU reference: dense GEMM (all four transpose combinations); the kernel also serves the grouped
// GEMMs, attention and the LM head (cpu/gemm.h).
// One kernel, c = alpha·a·b + beta·c on row-major operands; transposed operands are packed into a
// temporary first. The kernel keeps a kTileRows × kTileCols block of C in local accumulators and
// walks k once (the i-k-j order, register-blocked), so the inner loop over columns vectorises and
// every element is summed over k in ascending order. An accumulating call (alpha = beta = 1)
// starts the sums from C itself: c + a₀b₀ + a₁b₁ + … in that order, so splitting k into pieces
// (token chunks of a weight gradient, micro-batches) and accumulating them in turn gives the
// same bits as one call over the whole of k.
#include "ops/cpu/gemm.h"

#include <omp.h>

#include <algorithm>
#include <vector>

#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

// 4 rows × 32 columns: the accumulators fit the vector registers with room for the operands
// (baseline x86-64 code on a 2-core EPYC: ~55 GFLOP/s fp32 versus ~35 for the plain i-k-j loop).
constexpr int64_t kTileRows = 4;
constexpr int64_t kTileCols = 32;

template <class T>
struct GemmArgs {
  T* c;
  int64_t ldc;
  const T* a;
  int64_t lda;
  const T* b;
  int64_t ldb;
  int64_t m, n, k;
  T alpha, beta;
};

// Rows [i0, i0 + kTileRows) of c, all columns. Inlined into the per-ISA clones below.
template <class T>
[[gnu::always_inline]] inline void gemm_row_strip(const GemmArgs<T>& g, int64_t i0) {
  const int64_t rows = std::min(kTileRows, g.m - i0);
  for (int64_t j0 = 0; j0 < g.n; j0 += kTileCols) {
    const int64_t cols = std::min(kTileCols, g.n - j0);
    T acc[kTileRows][kTileCols] = {};
    const bool accumulate = g.alpha == T(1) && g.beta == T(1);
    if (accumulate)
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t j = 0; j < cols; ++j) acc[r][j] = g.c[(i0 + r) * g.ldc + j0 + j];
    if (rows == kTileRows && cols == kTileCols) {
      // Full tile: constant trip counts let the compiler keep acc in registers.
      for (int64_t kk = 0; kk < g.k; ++kk) {
        const T* br = g.b + kk * g.ldb + j0;
        for (int64_t r = 0; r < kTileRows; ++r) {
          const T ar = g.a[(i0 + r) * g.lda + kk];
          for (int64_t j = 0; j < kTileCols; ++j) acc[r][j] += ar * br[j];
        }
      }
    } else {
      for (int64_t kk = 0; kk < g.k; ++kk) {
        const T* br = g.b + kk * g.ldb + j0;
        for (int64_t r = 0; r < rows; ++r) {
          const T ar = g.a[(i0 + r) * g.lda + kk];
          for (int64_t j = 0; j < cols; ++j) acc[r][j] += ar * br[j];
        }
      }
    }
    for (int64_t r = 0; r < rows; ++r) {
      T* cr = g.c + (i0 + r) * g.ldc + j0;
      if (accumulate) {
        for (int64_t j = 0; j < cols; ++j) cr[j] = acc[r][j];
      } else if (g.beta == T(0)) {
        for (int64_t j = 0; j < cols; ++j) cr[j] = g.alpha * acc[r][j];
      } else {
        for (int64_t j = 0; j < cols; ++j) cr[j] = g.alpha * acc[r][j] + g.beta * cr[j];
      }
    }
  }
}

// The strip is compiled twice on x86-64, for AVX2 and the baseline, and picked at load time
// (measured 1.3–1.5× on the 2-core EPYC). "avx2" does not enable FMA, so both clones do the same
// rounded multiplies and adds in the same order: results are bit-identical on every machine.
#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define MOP_GEMM_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define MOP_GEMM_CLONES
#endif

MOP_GEMM_CLONES void gemm_row_strip_f32(const GemmArgs<float>& g, int64_t i0) {
  gemm_row_strip(g, i0);
}
MOP_GEMM_CLONES void gemm_row_strip_f64(const GemmArgs<double>& g, int64_t i0) {
  gemm_row_strip(g, i0);
}
void row_strip(const GemmArgs<float>& g, int64_t i0) {
  gemm_row_strip_f32(g, i0);
}
void row_strip(const GemmArgs<double>& g, int64_t i0) {
  gemm_row_strip_f64(g, i0);
}

}  // namespace

template <class T>
void gemm_nn(T* c, int64_t ldc, const T* a, int64_t lda, const T* b, int64_t ldb, int64_t m,
             int64_t n, int64_t k, T alpha, T beta) {
  const GemmArgs<T> g{c, ldc, a, lda, b, ldb, m, n, k, alpha, beta};
  const int64_t num_strips = (m + kTileRows - 1) / kTileRows;
  // Callers that are themselves parallel (attention tasks) run their GEMMs on their own thread.
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (int64_t s = 0; s < num_strips; ++s) row_strip(g, s * kTileRows);
}

template <class T>
void transpose(T* dst, const T* src, int64_t rows, int64_t cols) {
  // Square blocks keep both the strided reads and the writes within a few cache lines each.
  constexpr int64_t kBlock = 32;
  const int64_t num_col_blocks = (cols + kBlock - 1) / kBlock;
#pragma omp parallel for schedule(static) if (!omp_in_parallel())
  for (int64_t jb = 0; jb < num_col_blocks; ++jb) {
    const int64_t j0 = jb * kBlock, j1 = std::min(cols, j0 + kBlock);
    for (int64_t i0 = 0; i0 < rows; i0 += kBlock) {
      const int64_t i1 = std::min(rows, i0 + kBlock);
      for (int64_t j = j0; j < j1; ++j)
        for (int64_t i = i0; i < i1; ++i) dst[j * rows + i] = src[i * cols + j];
    }
  }
}

template <class T>
void gemm_op(T* c, const T* a, bool trans_a, const T* b, bool trans_b, int64_t m, int64_t n,
             int64_t k, T alpha, T beta) {
  std::vector<T> a_packed, b_packed;
  if (trans_a) {  // a is [k,m]
    a_packed.resize(size_t(m * k));
    transpose(a_packed.data(), a, k, m);
    a = a_packed.data();
  }
  if (trans_b) {  // b is [n,k]
    b_packed.resize(size_t(k * n));
    transpose(b_packed.data(), b, n, k);
    b = b_packed.data();
  }
  gemm_nn(c, a, b, m, n, k, alpha, beta);
}

template void gemm_nn<float>(float*, int64_t, const float*, int64_t, const float*, int64_t, int64_t,
                             int64_t, int64_t, float, float);
template void gemm_nn<double>(double*, int64_t, const double*, int64_t, const double*, int64_t,
                              int64_t, int64_t, int64_t, double, double);
template void transpose<float>(float*, const float*, int64_t, int64_t);
template void transpose<double>(double*, const double*, int64_t, int64_t);
template void gemm_op<float>(float*, const float*, bool, const float*, bool, int64_t, int64_t,
                             int64_t, float, float);
template void gemm_op<double>(double*, const double*, bool, const double*, bool, int64_t, int64_t,
                              int64_t, double, double);

// c may be compute or acc dtype; on the CPU both are the compute dtype.
void CpuBackend::gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                      float alpha, float beta) {
  const int64_t m = trans_a ? a.shape[1] : a.shape[0];
  const int64_t k = trans_a ? a.shape[0] : a.shape[1];
  const int64_t n = trans_b ? b.shape[0] : b.shape[1];
  dispatch_float(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    gemm_op(c.ptr<T>(), a.ptr<T>(), trans_a, b.ptr<T>(), trans_b, m, n, k, T(alpha), T(beta));
  });
}

}  // namespace mop::cpu
