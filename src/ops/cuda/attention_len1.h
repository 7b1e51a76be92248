// Attention over one-token sequences (S = 1), which cuDNN's flash backward rejects
// (s_q = s_kv = 1). The softmax over one key is exactly 1, so out = v (each query head copies its
// kv head), lse = scale·q·k, dq = dk = 0, and dv sums dout over the query heads of each kv head:
// cudaMemcpy2DAsync and cudaMemsetAsync, plus two strided-batched cuBLAS GEMMs (bf16 in, fp32
// accumulation). The one key is visible to the query with or without the causal mask, so both
// masks take this path. Tests and generation use it; so does ring attention when a cp rank's
// chunks are one token long (data.seq_len = 2·cp).
#pragma once

#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "ops/cuda/attention_cudnn.h"
#include "runtime/memory.h"

namespace mop {

class SingleTokenAttention {
 public:
  explicit SingleTokenAttention(cudaStream_t stream);
  ~SingleTokenAttention();
  SingleTokenAttention(const SingleTokenAttention&) = delete;
  SingleTokenAttention& operator=(const SingleTokenAttention&) = delete;

  // Same arguments as the cuDNN path; shape.seq must be 1.
  void fwd(const AttentionShape& shape, const AttentionFwdArgs& args);
  void bwd(const AttentionShape& shape, const AttentionBwdArgs& args);

 private:
  cudaStream_t stream_;
  cublasHandle_t handle_ = nullptr;
  Buffer ones_;  // bf16 1.0 × (query heads per kv head): the B operand of the dv head sum
};

}  // namespace mop
