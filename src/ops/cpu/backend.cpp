// The CPU reference backend: CpuBackend (cpu.h) behind the Ops front. Its hooks are in one
// src/ops/cpu/<stem>.cpp per stem; the fused AdamW + cast is the two steps in turn here.
#include "ops/cpu/cpu.h"

namespace mop {
namespace cpu {

void CpuBackend::adamw_step_cast(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                                 const AdamWArgs& args, Tensor weights) {
  adamw_step(param, m, v, grad, args);
  copy(weights, param);
}

}  // namespace cpu

std::unique_ptr<Ops> make_cpu_ops() {
  return std::make_unique<Ops>(std::make_shared<cpu::CpuBackend>());
}

}  // namespace mop
