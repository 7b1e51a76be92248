// CudaOps: the Ops front over a CUDA backend of its own (its own stream), for tests and
// benchmarks that hold one directly; the trainer gets its front from make_ops(). Binaries built
// with MOP_CUDA only.
#pragma once

#include <cuda_runtime.h>

#include "ops/ops.h"

namespace mop {

class CudaOps : public Ops {
 public:
  CudaOps();
  cudaStream_t cuda_stream() const;
};

}  // namespace mop
