// Dense GEMM kernel of the CPU reference, shared by gemm, grouped GEMM, attention and the fused LM
// head. Row-major operands with explicit row strides (leading dimensions). Each element of C is
// one sum over k in ascending order, accumulated in T (float for f32 runs, double for f64) and
// computed by exactly one thread: results are bit-identical whatever the thread count.
#pragma once

#include <cstdint>

namespace mop::cpu {

// c[m,n] = alpha·a[m,k]·b[k,n] + beta·c, rows of c/a/b ldc/lda/ldb elements apart. beta == 0
// never reads c (it may hold NaN poison). Parallel over rows of c unless called from inside a
// parallel region (then it runs on the calling thread).
template <class T>
void gemm_nn(T* c, int64_t ldc, const T* a, int64_t lda, const T* b, int64_t ldb, int64_t m,
             int64_t n, int64_t k, T alpha, T beta);

// Contiguous operands: ldc = n, lda = k, ldb = n.
template <class T>
void gemm_nn(T* c, const T* a, const T* b, int64_t m, int64_t n, int64_t k, T alpha, T beta) {
  gemm_nn(c, n, a, k, b, n, m, n, k, alpha, beta);
}

// dst[cols,rows] = src[rows,cols]ᵀ (contiguous).
template <class T>
void transpose(T* dst, const T* src, int64_t rows, int64_t cols);

// c[m,n] = alpha·op(a)·op(b) + beta·c, contiguous; a transposed operand is packed first.
template <class T>
void gemm_op(T* c, const T* a, bool trans_a, const T* b, bool trans_b, int64_t m, int64_t n,
             int64_t k, T alpha, T beta);

}  // namespace mop::cpu
