// CUDA backend, rope stem: the rotary embedding in place and its inverse (kernels/rope.cu), with
// the inverse-frequency tables cached per (theta, head dim) in the pointwise state.
#include <math.h>

#include <cstring>

#include "kernels/rope.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/pointwise.h"
#include "runtime/cuda_check.h"

namespace mop {
namespace {

// Device inv_freq[i] = 1/theta^(2i/dim), computed on the host exactly as the CPU reference does
// (::powf in fp32; the device powf may differ by an ulp), uploaded once per (theta, dim).
const float* rope_inv_freq(PointwiseState& s, float theta, int64_t dim, cudaStream_t stream) {
  uint32_t bits;
  std::memcpy(&bits, &theta, sizeof(bits));
  float* device = static_cast<float*>(s.rope_device.data());
  float* host = static_cast<float*>(s.rope_host.data());
  int slot = -1;
  for (int i = 0; i < kRopeSlots; ++i) {
    const PointwiseState::RopeSlot& r = s.rope_slots[i];
    if (r.used && r.theta_bits == bits && r.dim == dim)
      return device + size_t(i) * kernels::kRopeMaxHalfDim;
    if (!r.used && slot < 0) slot = i;
  }
  if (slot < 0) {  // all slots hold other tables: reuse one once its upload has surely run
    slot = s.rope_next_victim;
    s.rope_next_victim = (s.rope_next_victim + 1) % kRopeSlots;
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  float* h = host + size_t(slot) * kernels::kRopeMaxHalfDim;
  float* d = device + size_t(slot) * kernels::kRopeMaxHalfDim;
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) h[i] = 1.0f / ::powf(theta, float(2 * i) / float(dim));
  MOP_CUDA_CHECK(
      cudaMemcpyAsync(d, h, size_t(half) * sizeof(float), cudaMemcpyHostToDevice, stream));
  s.rope_slots[slot] = {bits, dim, true};
  return d;
}

}  // namespace

// ---- RoPE -------------------------------------------------------------------------------------

namespace {
// The kernel's limit on the head dim (the front checked the rest).
void check_rope(const Tensor& x, const char* op) {
  MOP_CHECK(x.shape[2] / 2 <= kernels::kRopeMaxHalfDim, op, ": head dim ", x.shape[2], " exceeds ",
            2 * kernels::kRopeMaxHalfDim);
}
}  // namespace

void CudaBackend::rope_fwd(Tensor x, const Tensor& pos, float theta) {
  check_rope(x, "rope_fwd");
  if (x.numel() == 0) return;
  PointwiseState& s = pointwise_state();
  const float* inv_freq = rope_inv_freq(s, theta, x.shape[2], stream_);
  kernels::rope(bf16_ptr(x), pos.ptr<int32_t>(), inv_freq, x.shape[0], x.shape[1], x.shape[2],
                false, stream_);
}

void CudaBackend::rope_bwd(Tensor dx, const Tensor& pos, float theta) {
  check_rope(dx, "rope_bwd");
  if (dx.numel() == 0) return;
  PointwiseState& s = pointwise_state();
  const float* inv_freq = rope_inv_freq(s, theta, dx.shape[2], stream_);
  kernels::rope(bf16_ptr(dx), pos.ptr<int32_t>(), inv_freq, dx.shape[0], dx.shape[1], dx.shape[2],
                true, stream_);
}

}  // namespace mop
