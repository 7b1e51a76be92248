// Front of the rotary position embedding (in place; backward = inverse rotation): the checks,
// then the backend's hooks (cpu/rope.cpp, cuda/rope.cpp, kernels/rope.cu).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {
namespace {
void check_rope(const Ops& ops, const Tensor& x, const Tensor& pos, float theta, const char* op) {
  MOP_CHECK(x.ndim == 3 && x.shape[2] % 2 == 0, op, ": x must be [T,heads,D] with D even, is ",
            x.shape_str());
  const DType dt = ops.compute_dtype(x, op);
  ops.expect(x, op, dt, {x.shape[0], x.shape[1], x.shape[2]});
  ops.expect(pos, "rope: pos", DType::I32, {x.shape[0]});
  MOP_CHECK(theta > 0, op, ": theta = ", theta);
}
}  // namespace

void Ops::rope_fwd(Tensor x, const Tensor& pos, float theta) {
  check_rope(*this, x, pos, theta, "rope_fwd");
  run(OpId::rope_fwd, &OpsBackend::rope_fwd, x, pos, theta);
}

void Ops::rope_bwd(Tensor dx, const Tensor& pos, float theta) {
  check_rope(*this, dx, pos, theta, "rope_bwd");
  run(OpId::rope_bwd, &OpsBackend::rope_bwd, dx, pos, theta);
}

}  // namespace mop
