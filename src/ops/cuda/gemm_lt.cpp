// LtGemm: cuBLASLt matmuls with one heuristic query per distinct call shape (plans cached on the
// host), and cublasGemmEx for what cuBLASLt declines (no algorithm for an alignment or a shape).
#include "ops/cuda/gemm_lt.h"

#include <algorithm>

#include "runtime/cuda_check.h"

namespace mop {

ColMajorGemm to_col_major(const GemmCall& g) {
  ColMajorGemm cm;
  cm.trans_a = g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
  cm.trans_b = g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
  cm.m = g.n;
  cm.n = g.m;
  cm.k = g.k;
  // Row lengths of the row-major operands; cuBLAS wants ≥ 1 even when a dimension is empty.
  cm.lda = std::max<int64_t>(1, g.trans_b ? g.k : g.n);
  cm.ldb = std::max<int64_t>(1, g.trans_a ? g.m : g.k);
  cm.ldc = std::max<int64_t>(1, g.n);
  cm.a = g.b;
  cm.b = g.a;
  return cm;
}

uint32_t pointer_alignment(const void* p) {
  const uintptr_t u = reinterpret_cast<uintptr_t>(p);
  if (u == 0) return 256;
  return uint32_t(std::min<uintptr_t>(u & (~u + 1), 256));
}

namespace {

cudaDataType_t cuda_type(DType t) {
  return t == DType::F32 ? CUDA_R_32F : CUDA_R_16BF;
}

template <class T>
void set_desc(cublasLtMatmulDesc_t d, cublasLtMatmulDescAttributes_t attr, T value) {
  MOP_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(d, attr, &value, sizeof(value)));
}

template <class T>
void set_pref(cublasLtMatmulPreference_t p, cublasLtMatmulPreferenceAttributes_t attr, T value) {
  MOP_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(p, attr, &value, sizeof(value)));
}

}  // namespace

LtGemm::LtGemm() {
  MOP_CUBLAS_CHECK(cublasLtCreate(&lt_));
  MOP_CUBLAS_CHECK(cublasCreate(&blas_));
}

LtGemm::~LtGemm() {
  for (auto& [key, p] : plans_) {
    if (p.desc) cublasLtMatmulDescDestroy(p.desc);
    if (p.a) cublasLtMatrixLayoutDestroy(p.a);
    if (p.b) cublasLtMatrixLayoutDestroy(p.b);
    if (p.c) cublasLtMatrixLayoutDestroy(p.c);
  }
  if (blas_) cublasDestroy(blas_);
  if (lt_) cublasLtDestroy(lt_);
}

void LtGemm::bind_blas(const GemmLane& lane) {
  MOP_CUBLAS_CHECK(cublasSetStream(blas_, lane.stream));
  MOP_CUBLAS_CHECK(cublasSetWorkspace(blas_, lane.workspace, lane.workspace_bytes));
}

const LtGemm::Plan& LtGemm::plan(const GemmCall& g, const GemmLane& lane) {
  const Key key{g.m,
                g.n,
                g.k,
                g.trans_a,
                g.trans_b,
                g.c_dtype,
                pointer_alignment(g.a),
                pointer_alignment(g.b),
                pointer_alignment(g.c),
                lane.workspace_bytes};
  auto it = plans_.find(key);
  if (it == plans_.end()) it = plans_.emplace(key, make_plan(key, g)).first;
  return it->second;
}

LtGemm::Plan LtGemm::make_plan(const Key& key, const GemmCall& g) const {
  const ColMajorGemm cm = to_col_major(g);
  Plan p;
  MOP_CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
  set_desc<int32_t>(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, cm.trans_a);
  set_desc<int32_t>(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, cm.trans_b);
  // Layouts describe the stored (column-major) matrices, before op().
  const bool a_n = cm.trans_a == CUBLAS_OP_N, b_n = cm.trans_b == CUBLAS_OP_N;
  MOP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.a, CUDA_R_16BF, uint64_t(a_n ? cm.m : cm.k),
                                              uint64_t(a_n ? cm.k : cm.m), cm.lda));
  MOP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.b, CUDA_R_16BF, uint64_t(b_n ? cm.k : cm.n),
                                              uint64_t(b_n ? cm.n : cm.k), cm.ldb));
  MOP_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.c, cuda_type(key.c_dtype), uint64_t(cm.m),
                                              uint64_t(cm.n), cm.ldc));

  cublasLtMatmulPreference_t pref = nullptr;
  MOP_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
  set_pref<uint64_t>(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, key.workspace_bytes);
  // The heuristic assumes 256-byte aligned pointers unless told otherwise; expert and chunk
  // sub-matrices start wherever their first row does. cuBLAS's A is our b, its B our a.
  set_pref<uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, key.align_b);
  set_pref<uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, key.align_a);
  set_pref<uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, key.align_c);
  set_pref<uint32_t>(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, key.align_c);
  // Split-K: partial sums must stay fp32 for a bf16 C (the output-type scheme would round each
  // part to bf16), and the in-place scheme (parts added into C, ordered by counters) is left out
  // too, as a precaution for bitwise reproducibility. Algorithms without split-K always pass.
  set_pref<uint32_t>(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                     key.c_dtype == DType::BF16 ? CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE
                                                : CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE |
                                                      CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE);
  cublasLtMatmulHeuristicResult_t result{};
  int found = 0;
  const cublasStatus_t st =
      cublasLtMatmulAlgoGetHeuristic(lt_, p.desc, p.a, p.b, p.c, p.c, pref, 1, &result, &found);
  cublasLtMatmulPreferenceDestroy(pref);
  p.use_lt = st == CUBLAS_STATUS_SUCCESS && found > 0 && result.state == CUBLAS_STATUS_SUCCESS;
  if (p.use_lt) p.algo = result.algo;
  return p;
}

void LtGemm::run(const GemmCall& g, const GemmLane& lane) {
  MOP_CHECK(g.c_dtype == DType::BF16 || g.c_dtype == DType::F32, "gemm: c dtype ",
            dtype_name(g.c_dtype));
  MOP_CHECK(g.m >= 0 && g.n >= 0 && g.k >= 0, "gemm: negative size");
  if (g.m == 0 || g.n == 0) return;
  if (g.k == 0) {  // c = beta·c
    if (g.beta == 0) {
      // All-zero bits are 0.0 in bf16 and fp32; beta = 0 must not read c (it may hold NaN).
      MOP_CUDA_CHECK(
          cudaMemsetAsync(g.c, 0, size_t(g.m * g.n) * dtype_size(g.c_dtype), lane.stream));
    } else if (g.beta != 1) {
      run_blas(g, lane);
    }
    return;
  }
  const Plan& p = plan(g, lane);
  if (!p.use_lt) {
    run_blas(g, lane);
    return;
  }
  const ColMajorGemm cm = to_col_major(g);
  MOP_CUBLAS_CHECK(cublasLtMatmul(lt_, p.desc, &g.alpha, cm.a, p.a, cm.b, p.b, &g.beta, g.c, p.c,
                                  g.c, p.c, &p.algo, lane.workspace, lane.workspace_bytes,
                                  lane.stream));
}

void LtGemm::run_blas(const GemmCall& g, const GemmLane& lane) {
  const ColMajorGemm cm = to_col_major(g);
  bind_blas(lane);
  MOP_CUBLAS_CHECK(cublasGemmEx_64(blas_, cm.trans_a, cm.trans_b, cm.m, cm.n, cm.k, &g.alpha, cm.a,
                                   CUDA_R_16BF, cm.lda, cm.b, CUDA_R_16BF, cm.ldb, &g.beta, g.c,
                                   cuda_type(g.c_dtype), cm.ldc, CUBLAS_COMPUTE_32F,
                                   CUBLAS_GEMM_DEFAULT));
}

}  // namespace mop
