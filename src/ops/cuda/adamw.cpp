// CUDA backend, adamw stem: the AdamW step, fused with the cast to bf16 compute weights when
// asked (kernels/adamw.cu); other weight dtypes take the step and a copy.
#include <cmath>

#include "kernels/adamw.cuh"
#include "ops/cuda/backend.h"

namespace mop {

// ---- AdamW ------------------------------------------------------------------------------------

void CudaBackend::adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                         const AdamWArgs& args) {
  adamw_step_cast(param, m, v, grad, args, Tensor());
}

void CudaBackend::adamw_step_cast(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                              const AdamWArgs& args, Tensor weights) {
  if (weights.data && weights.dtype != DType::BF16) {  // only bf16 compute weights are fused
    adamw_step(param, m, v, grad, args);
    copy(weights, param);
    return;
  }
  const int64_t n = param.numel();
  // The per-call constants exactly as cpu/adamw.cpp forms them, in float. lr·wd goes through a
  // volatile so the compiler cannot fuse 1 − lr·wd into one FMA (the reference rounds the product).
  kernels::AdamWConstants c;
  c.beta1 = args.beta1;
  c.beta2 = args.beta2;
  c.eps = args.eps;
  c.grad_scale = args.grad_scale;
  c.one_minus_beta1 = 1.0f - args.beta1;
  c.one_minus_beta2 = 1.0f - args.beta2;
  c.step_size = args.lr / args.bias_correction1;
  c.sqrt_bc2 = std::sqrt(args.bias_correction2);
  volatile float lr_wd = args.lr * args.weight_decay;
  c.decay = 1.0f - lr_wd;
  kernels::adamw_step(param.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.data, grad.dtype,
                      static_cast<uint16_t*>(weights.data), n, c, stream_);
}

}  // namespace mop
