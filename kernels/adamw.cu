// AdamW kernel: one thread per 4 consecutive elements (16-byte param/m/v accesses) when the
// pointers allow, scalars otherwise. Every float operation is an explicit round-to-nearest
// intrinsic (__fmul_rn, __fadd_rn, …), which nvcc never contracts into a fused multiply-add, so
// the result equals the CPU reference bit for bit (both are IEEE with subnormals kept).
#include <algorithm>

#include "runtime/cuda_check.h"
#include "kernels/adamw.cuh"
#include "kernels/elementwise.cuh"

namespace mop::kernels {
namespace {

using namespace detail;

constexpr int kThreads = 256;
constexpr int kVec = 4;

using Bf16Bits = uint16_t;

template <class G>
__device__ __forceinline__ float grad_to_float(G g) {
  if constexpr (std::is_same_v<G, Bf16Bits>)
    return bf16_bits_to_float(g);
  else if constexpr (std::is_same_v<G, double>)
    return __double2float_rn(g);
  else
    return g;
}

// src/ops/cpu/adamw.cpp's adamw_impl, operation for operation.
__device__ __forceinline__ void adamw_element(float& p, float& m, float& v, float grad,
                                              const AdamWConstants& c) {
  const float g = __fmul_rn(grad, c.grad_scale);
  const float mi = __fadd_rn(__fmul_rn(c.beta1, m), __fmul_rn(c.one_minus_beta1, g));
  const float vi = __fadd_rn(__fmul_rn(c.beta2, v), __fmul_rn(c.one_minus_beta2, __fmul_rn(g, g)));
  const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.sqrt_bc2), c.eps);
  p = __fsub_rn(__fmul_rn(p, c.decay), __fdiv_rn(__fmul_rn(c.step_size, mi), denom));
  m = mi;
  v = vi;
}

template <class G>
__global__ void __launch_bounds__(kThreads)
    adamw_kernel(float* __restrict__ param, float* __restrict__ m, float* __restrict__ v,
                 const G* __restrict__ grad, uint16_t* __restrict__ weights, int64_t n,
                 int64_t num_vec, AdamWConstants c) {
  const int64_t stride = int64_t(gridDim.x) * blockDim.x;
  const int64_t tid = int64_t(blockIdx.x) * blockDim.x + threadIdx.x;
  for (int64_t i = tid; i < num_vec; i += stride) {
    Packed<float, kVec> p = load_packed<float, kVec>(param + i * kVec);
    Packed<float, kVec> mm = load_packed<float, kVec>(m + i * kVec);
    Packed<float, kVec> vv = load_packed<float, kVec>(v + i * kVec);
    const Packed<G, kVec> g = load_packed<G, kVec>(grad + i * kVec);
#pragma unroll
    for (int k = 0; k < kVec; ++k)
      adamw_element(p.v[k], mm.v[k], vv.v[k], grad_to_float(g.v[k]), c);
    store_packed(param + i * kVec, p);
    store_packed(m + i * kVec, mm);
    store_packed(v + i * kVec, vv);
    if (weights) {
      Packed<uint16_t, kVec> w;
#pragma unroll
      for (int k = 0; k < kVec; ++k) w.v[k] = float_to_bf16_bits(p.v[k]);
      store_packed(weights + i * kVec, w);
    }
  }
  for (int64_t i = num_vec * kVec + tid; i < n; i += stride) {
    float p = param[i], mi = m[i], vi = v[i];
    adamw_element(p, mi, vi, grad_to_float(grad[i]), c);
    param[i] = p;
    m[i] = mi;
    v[i] = vi;
    if (weights) weights[i] = float_to_bf16_bits(p);
  }
}

}  // namespace

void adamw_step(float* param, float* m, float* v, const void* grad, DType grad_dtype,
                uint16_t* weights_bf16, int64_t n, const AdamWConstants& c, cudaStream_t stream) {
  MOP_CHECK(n >= 0 && ((param && m && v && grad) || n == 0), "adamw_step: n = ", n);
  if (n == 0) return;
  auto launch = [&](auto tag) {
    using G = decltype(tag);
    const bool vec = aligned_to(param, 16) && aligned_to(m, 16) && aligned_to(v, 16) &&
                     aligned_to(grad, std::min<size_t>(16, kVec * sizeof(G))) &&
                     (!weights_bf16 || aligned_to(weights_bf16, kVec * sizeof(uint16_t)));
    const int64_t num_vec = vec ? n / kVec : 0;
    const int64_t items = std::max(num_vec, n - num_vec * kVec);
    adamw_kernel<G><<<grid_for(items, kThreads), kThreads, 0, stream>>>(
        param, m, v, static_cast<const G*>(grad), weights_bf16, n, num_vec, c);
  };
  switch (grad_dtype) {
    case DType::F32:
      launch(float{});
      break;
    case DType::BF16:
      launch(Bf16Bits{});
      break;
    case DType::F64:
      launch(double{});
      break;
    default:
      MOP_CHECK(false, "adamw_step: grad dtype ", dtype_name(grad_dtype));
  }
  MOP_CUDA_CHECK_LAUNCH();
}

}  // namespace mop::kernels
