// Front of the AdamW step (and its fused form that also writes the compute weights): the checks,
// then the backend's hooks (cpu/adamw.cpp, cuda/adamw.cpp, kernels/adamw.cu).
#include <initializer_list>

#include "core/error.h"
#include "ops/ops.h"

namespace mop {
namespace {
void check_adamw(Device device, const Tensor& param, const Tensor& m, const Tensor& v,
                 const Tensor& grad, const AdamWArgs& args) {
  const int64_t n = param.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &m, &v, &grad}) {
    MOP_CHECK(t->device == device, "adamw_step: tensors must be on the ", device_name(device));
    MOP_CHECK(t->numel() == n && (t->data || n == 0), "adamw_step: ", t->shape_str(), " vs param ",
              param.shape_str());
  }
  MOP_CHECK(param.dtype == DType::F32 && m.dtype == DType::F32 && v.dtype == DType::F32,
            "adamw_step: param, m and v must be f32");
  MOP_CHECK(dtype_is_float(grad.dtype), "adamw_step: grad dtype ", dtype_name(grad.dtype));
  MOP_CHECK(args.bias_correction1 > 0 && args.bias_correction2 > 0,
            "adamw_step: bias corrections must be positive (1 − β^step, step ≥ 1)");
}
}  // namespace

void Ops::adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad, const AdamWArgs& args) {
  check_adamw(device(), param, m, v, grad, args);
  run(OpId::adamw_step, &OpsBackend::adamw_step, param, m, v, grad, args);
}

void Ops::adamw_step_cast(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                          const AdamWArgs& args, Tensor weights) {
  check_adamw(device(), param, m, v, grad, args);
  MOP_CHECK(weights.device == device() && dtype_is_float(weights.dtype) &&
                weights.numel() == param.numel() && (weights.data || param.numel() == 0),
            "adamw_step_cast: weights ", dtype_name(weights.dtype), " ", weights.shape_str(),
            " on ", device_name(weights.device), " vs param ", param.shape_str());
  run(OpId::adamw_step_cast, &OpsBackend::adamw_step_cast, param, m, v, grad, args, weights);
}

}  // namespace mop
