// Internal to the CPU reference backend: float/double dispatch and the backend's class, whose
// hooks live in one src/ops/cpu/<stem>.cpp per stem. The front has checked shapes, dtypes and
// devices, so the hooks check only what they read (indices, offsets, targets). Nothing outside src/ops/cpu/ includes this. On the CPU the acc dtype equals
// the compute dtype (acc_dtype(F32) = F32, acc_dtype(F64) = F64), so every op is templated on
// one element type T that serves as both.
#pragma once

#include <cstdint>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"

namespace mop::cpu {

// Calls f(T{}) with T = float or double for a compute dtype.
template <class F>
void dispatch_float(DType dtype, F&& f) {
  switch (dtype) {
    case DType::F32:
      f(float{});
      return;
    case DType::F64:
      f(double{});
      return;
    default:
      MOP_CHECK(false, "dtype ", dtype_name(dtype), " is not a CPU compute dtype");
  }
}

// The hooks, one src/ops/cpu/<stem>.cpp per stem (backend.cpp: the rest).
class CpuBackend final : public OpsBackend {
 public:
  Device device() const override { return Device::CPU; }
  std::vector<DType> compute_dtypes() const override { return {DType::F32, DType::F64}; }

#define MOP_OP(name, category, params, args) void name params override;
#include "ops/op_list.inc"
#undef MOP_OP
};

}  // namespace mop::cpu
