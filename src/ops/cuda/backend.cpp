// CudaBackend context (stream, pinned staging), preparation, and copy(): same-dtype copies in any
// direction are cudaMemcpyAsync; dtype conversions run on the device when both sides are there,
// and otherwise go through the pinned staging buffer in chunks (small tensors: losses, norms).
// Also the factory and the CudaOps front.
#include "ops/cuda/backend.h"

#include <algorithm>
#include <cstring>

#include "ops/cuda_ops.h"
#include "runtime/cuda_check.h"

namespace mop {

namespace {
constexpr size_t kStagingBytes = size_t(8) << 20;
}

CudaBackend::CudaBackend() {
  MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  staging_ = Buffer(MemKind::Pinned, kStagingBytes);
}

CudaBackend::~CudaBackend() {
  if (stream_) {
    cudaStreamSynchronize(stream_);
    // Family states release their resources (handles, plans, workspaces) before the stream goes.
    gemm_.reset();
    attention_.reset();
    moe_.reset();
    pointwise_.reset();
    cudaStreamDestroy(stream_);
  }
}

void CudaBackend::synchronize() { MOP_CUDA_CHECK(cudaStreamSynchronize(stream_)); }

void CudaBackend::prepare(const OpShapes& shapes) {
  prepare_pointwise(shapes);
  prepare_gemm(shapes);
  prepare_moe(shapes);
  prepare_attention(shapes);
  synchronize();
}

size_t CudaBackend::workspace_bytes() const {
  return staging_.bytes() + gemm_workspace_bytes() + attention_workspace_bytes() +
         moe_workspace_bytes() + pointwise_workspace_bytes();
}

void CudaBackend::copy(Tensor dst, const Tensor& src) {
  const int64_t n = src.numel();
  if (n == 0) return;
  const bool dst_dev = dst.device == Device::CUDA, src_dev = src.device == Device::CUDA;
  if (dst.dtype == src.dtype) {
    cudaMemcpyKind kind = dst_dev ? (src_dev ? cudaMemcpyDeviceToDevice : cudaMemcpyHostToDevice)
                                  : (src_dev ? cudaMemcpyDeviceToHost : cudaMemcpyHostToHost);
    if (dst.data != src.data)
      MOP_CUDA_CHECK(cudaMemcpyAsync(dst.data, src.data, src.bytes(), kind, stream_));
    if (!dst_dev || !src_dev) synchronize();  // the host side may be read or reused right away
    return;
  }
  if (dst_dev && src_dev) {
    convert_device(dst.data, dst.dtype, src.data, src.dtype, n);
    return;
  }
  // A dtype change across devices: through the pinned staging buffer, chunk by chunk; the
  // conversion itself is the CPU reference's copy (same rounding as everywhere else).
  static const std::unique_ptr<Ops> host = make_cpu_ops();
  const size_t ssz = dtype_size(src.dtype), dsz = dtype_size(dst.dtype);
  const int64_t chunk = int64_t(kStagingBytes / std::max(ssz, dsz));
  for (int64_t done = 0; done < n; done += chunk) {
    const int64_t m = std::min(chunk, n - done);
    char* sp = static_cast<char*>(src.data) + size_t(done) * ssz;
    char* dp = static_cast<char*>(dst.data) + size_t(done) * dsz;
    Tensor stage(staging_.data(), src_dev ? src.dtype : dst.dtype, {m}, Device::CPU);
    if (src_dev) {  // device → staging (src dtype) → convert into host dst
      MOP_CUDA_CHECK(cudaMemcpyAsync(stage.data, sp, size_t(m) * ssz, cudaMemcpyDeviceToHost, stream_));
      synchronize();
      host->copy(Tensor(dp, dst.dtype, {m}, Device::CPU), stage);
    } else {  // host src → convert into staging (dst dtype) → device
      host->copy(stage, Tensor(sp, src.dtype, {m}, Device::CPU));
      MOP_CUDA_CHECK(cudaMemcpyAsync(dp, stage.data, size_t(m) * dsz, cudaMemcpyHostToDevice, stream_));
      synchronize();
    }
  }
}

std::unique_ptr<Ops> make_cuda_ops(int local_rank) {
  int count = 0;
  cudaError_t e = cudaGetDeviceCount(&count);
  MOP_USER_CHECK(e == cudaSuccess && count > 0, "train.device: cuda, but no CUDA device is available",
                 e == cudaSuccess ? std::string() : std::string(" (") + cudaGetErrorString(e) + ")");
  MOP_CUDA_CHECK(cudaSetDevice(local_rank % count));
  return std::make_unique<Ops>(std::make_shared<CudaBackend>());
}

CudaOps::CudaOps() : Ops(std::make_shared<CudaBackend>()) {}

cudaStream_t CudaOps::cuda_stream() const {
  return static_cast<const CudaBackend&>(*shared_backend()).cuda_stream();
}

}  // namespace mop
