// Checks for CUDA runtime, cuBLAS and cuDNN calls: a failure throws mop::Error naming the
// statement, the library's error string, file:line, rank and host. No fmt, so .cu files can use it.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include "core/error.h"

#define MOP_CUDA_CHECK(call)                                                              \
  do {                                                                                    \
    cudaError_t mop_err_ = (call);                                                        \
    if (mop_err_ != cudaSuccess) [[unlikely]]                                             \
      ::mop::detail::fail("CUDA error", #call, __FILE__, __LINE__,                        \
                          cudaGetErrorString(mop_err_));                                  \
  } while (0)

// After a kernel launch: launch-configuration errors surface here, not at the next sync.
#define MOP_CUDA_CHECK_LAUNCH() MOP_CUDA_CHECK(cudaGetLastError())

#define MOP_CUBLAS_CHECK(call)                                                            \
  do {                                                                                    \
    cublasStatus_t mop_st_ = (call);                                                      \
    if (mop_st_ != CUBLAS_STATUS_SUCCESS) [[unlikely]]                                    \
      ::mop::detail::fail("cuBLAS error", #call, __FILE__, __LINE__,                      \
                          cublasGetStatusString(mop_st_));                                \
  } while (0)
