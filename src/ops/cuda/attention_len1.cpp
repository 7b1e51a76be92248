// One-token-sequence attention (see attention_len1.h). cuBLAS is column-major: a row-major
// [rows, D] bf16 block of one kv row's query heads reads as a column-major [D, rows] matrix.
#include "ops/cuda/attention_len1.h"

#include <vector>

#include "runtime/cuda_check.h"
#include "core/dtype.h"

namespace mop {

SingleTokenAttention::SingleTokenAttention(cudaStream_t stream) : stream_(stream) {
  MOP_CUBLAS_CHECK(cublasCreate(&handle_));
  MOP_CUBLAS_CHECK(cublasSetStream(handle_, stream_));
}

SingleTokenAttention::~SingleTokenAttention() {
  if (handle_) cublasDestroy(handle_);
}

// With S = 1 every token is its own sequence: kv row r = t·Nkv + g holds k and v of token t, kv
// head g, and its group's query heads h = g·G + j (j < G) are q rows r·G + j, since
// t·Nq + g·G = (t·Nkv + g)·G. lse[b,h,0] sits at b·Nq + h = r·G + j as well.
void SingleTokenAttention::fwd(const AttentionShape& s, const AttentionFwdArgs& a) {
  MOP_CHECK(s.seq == 1, "single-token attention with S=", s.seq);
  const int64_t group = s.num_q_heads / s.num_kv_heads, dim = s.head_dim;
  const int64_t kv_rows = s.batch * s.num_kv_heads;
  const size_t row_bytes = size_t(dim) * sizeof(bf16);
  // out row r·G + j = v row r, for each j: a strided 2-D copy (destination pitch G rows).
  for (int64_t j = 0; j < group; ++j)
    MOP_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char*>(a.out) + size_t(j) * row_bytes,
                                     size_t(group) * row_bytes, a.v, row_bytes, row_bytes,
                                     size_t(kv_rows), cudaMemcpyDeviceToDevice, stream_));
  // lse_r[G] = scale · Q_rᵀ k_r with Q_r the column-major [D, G] block (lda D) of the group's
  // query heads and k_r the [D] key; fp32 out.
  const float alpha = a.scale, beta = 0;
  MOP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle_, CUBLAS_OP_T, CUBLAS_OP_N, int(group), 1, int(dim), &alpha, a.q, CUDA_R_16BF,
      int(dim), group * dim, a.k, CUDA_R_16BF, int(dim), dim, &beta, a.lse, CUDA_R_32F, int(group),
      group, int(kv_rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

void SingleTokenAttention::bwd(const AttentionShape& s, const AttentionBwdArgs& a) {
  MOP_CHECK(s.seq == 1, "single-token attention with S=", s.seq);
  const int64_t group = s.num_q_heads / s.num_kv_heads, dim = s.head_dim;
  const int64_t kv_rows = s.batch * s.num_kv_heads;
  // P = 1 has no gradient: dS = P·(dP − rowsum(dO ⊙ O)) = dO·v − dO·v = 0.
  MOP_CUDA_CHECK(cudaMemsetAsync(a.dq, 0, size_t(kv_rows * group * dim) * sizeof(bf16), stream_));
  MOP_CUDA_CHECK(cudaMemsetAsync(a.dk, 0, size_t(kv_rows * dim) * sizeof(bf16), stream_));
  if (ones_.bytes() < size_t(group) * sizeof(bf16)) {
    // First use only. The buffer's zero fill runs on the legacy stream, which our non-blocking
    // stream does not wait for: drain the device before filling it on our stream.
    ones_ = Buffer(MemKind::Device, size_t(group) * sizeof(bf16));
    MOP_CUDA_CHECK(cudaDeviceSynchronize());
    std::vector<bf16> host(size_t(group), float_to_bf16(1.0f));
    MOP_CUDA_CHECK(
        cudaMemcpyAsync(ones_.data(), host.data(), ones_.bytes(), cudaMemcpyHostToDevice, stream_));
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream_));  // `host` goes out of scope
  }
  // dv_r[D] = dO_r · 1 with dO_r the column-major [D, G] block of the group's query heads; the
  // ones vector is shared by every batch entry (stride 0). fp32 accumulation, bf16 out.
  const float one = 1, zero = 0;
  MOP_CUBLAS_CHECK(cublasGemmStridedBatchedEx(
      handle_, CUBLAS_OP_N, CUBLAS_OP_N, int(dim), 1, int(group), &one, a.dout, CUDA_R_16BF,
      int(dim), group * dim, ones_.data(), CUDA_R_16BF, int(group), 0, &zero, a.dv, CUDA_R_16BF,
      int(dim), dim, int(kv_rows), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
}

}  // namespace mop
