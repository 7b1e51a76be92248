// Row-major GEMMs on cuBLASLt for the CUDA backend: c[m,n] = alpha·op(a)·op(b) + beta·c with bf16
// a and b, bf16 or fp32 c, fp32 accumulation. Each (shape, transposes, c dtype, pointer alignments,
// workspace size) gets its algorithm from cuBLASLt's heuristic once and keeps it; shapes cuBLASLt
// has no algorithm for run through cublasGemmEx instead. LtGemm owns the cuBLASLt handle and the
// cuBLAS handle (the fallback, and cublasGemmGroupedBatchedEx in grouped_gemm.cpp).
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <map>

#include "core/dtype.h"

namespace mop {

// One row-major GEMM on contiguous operands: a is [m,k] ([k,m] when trans_a), b is [k,n] ([n,k]
// when trans_b), c is [m,n] of c_dtype (BF16 or F32); a and b are BF16.
struct GemmCall {
  void* c = nullptr;
  DType c_dtype = DType::BF16;
  const void* a = nullptr;
  bool trans_a = false;
  const void* b = nullptr;
  bool trans_b = false;
  int64_t m = 0, n = 0, k = 0;
  float alpha = 1, beta = 0;
};

// Where a GEMM runs: its stream and the device workspace only that stream uses meanwhile.
struct GemmLane {
  cudaStream_t stream = nullptr;
  void* workspace = nullptr;
  size_t workspace_bytes = 0;
};

// The same GEMM in cuBLAS's column-major terms. A row-major [r,c] matrix is a column-major [c,r]
// one, so c[m,n] = op(a)·op(b) becomes cᵀ[n,m] = op(b)ᵀ·op(a)ᵀ: cuBLAS's A is our b and its B our
// a.
struct ColMajorGemm {
  cublasOperation_t trans_a, trans_b;
  int64_t m, n, k;        // cuBLAS's: m = our n, n = our m
  int64_t lda, ldb, ldc;  // row lengths of our b, a, c
  const void* a;          // our b
  const void* b;          // our a
};
ColMajorGemm to_col_major(const GemmCall& g);

// The largest power of two (≤ 256) dividing a device address: the alignment cuBLASLt is told.
uint32_t pointer_alignment(const void* p);

class LtGemm {
 public:
  LtGemm();
  ~LtGemm();
  LtGemm(const LtGemm&) = delete;
  LtGemm& operator=(const LtGemm&) = delete;

  // Enqueues g on lane.stream. Needs no synchronisation and allocates nothing on the device.
  void run(const GemmCall& g, const GemmLane& lane);
  // Binds the cuBLAS handle to a lane (stream, then workspace: setting the stream resets the
  // workspace to cuBLAS's own pool, which would allocate), before any cuBLAS call.
  void bind_blas(const GemmLane& lane);
  cublasHandle_t blas() const { return blas_; }
  size_t num_plans() const { return plans_.size(); }

 private:
  struct Key {
    int64_t m, n, k;
    bool trans_a, trans_b;
    DType c_dtype;
    uint32_t align_a, align_b, align_c;
    size_t workspace_bytes;
    auto operator<=>(const Key&) const = default;
  };
  // cuBLASLt descriptors and the heuristic's algorithm, or use_lt = false for cublasGemmEx.
  struct Plan {
    cublasLtMatmulDesc_t desc = nullptr;
    cublasLtMatrixLayout_t a = nullptr, b = nullptr, c = nullptr;
    cublasLtMatmulAlgo_t algo{};
    bool use_lt = false;
  };
  const Plan& plan(const GemmCall& g, const GemmLane& lane);
  Plan make_plan(const Key& key, const GemmCall& g) const;
  void run_blas(const GemmCall& g, const GemmLane& lane);

  cublasLtHandle_t lt_ = nullptr;
  cublasHandle_t blas_ = nullptr;
  std::map<Key, Plan> plans_;
};

}  // namespace mop
