// AdamW step on the device (torch.optim.AdamW's decoupled form) on fp32 param/m/v with an f32,
// bf16 or f64 gradient. Bit-identical to the CPU reference (src/ops/cpu_adamw.cpp): the same
// float operations in the same order, each rounded on its own (no fused multiply-add), with the
// per-call constants computed once on the host exactly as the reference computes them.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "core/dtype.h"

namespace mop::kernels {

// The per-call constants, in float, as cpu_adamw.cpp forms them.
struct AdamWConstants {
  float beta1, beta2, eps, grad_scale;
  float one_minus_beta1;  // 1 − β1
  float one_minus_beta2;  // 1 − β2
  float step_size;        // lr / bc1
  float sqrt_bc2;         // sqrt(bc2)
  float decay;            // 1 − lr·wd (the product rounded first)
};

// Per element: g = float(grad)·grad_scale; m = β1·m + (1−β1)·g; v = β2·v + (1−β2)·(g·g);
// param = param·decay − (step_size·m) / (sqrt(v)/sqrt_bc2 + eps). n elements each. When
// weights_bf16 is not null it also receives the updated param rounded to bf16 (nearest-even), in
// the same pass (saves re-reading the fp32 master for the compute weights).
void adamw_step(float* param, float* m, float* v, const void* grad, DType grad_dtype,
                uint16_t* weights_bf16, int64_t n, const AdamWConstants& c, cudaStream_t stream);

}  // namespace mop::kernels
