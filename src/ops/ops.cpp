// The shared argument check and the backend factory (see ops.h).
#include <string>

#include "core/error.h"
#include "ops/ops.h"

namespace mop {

void expect_tensor(const Tensor& t, const char* name, std::optional<Device> device, DType dtype,
                   std::initializer_list<int64_t> dims) {
  MOP_CHECK(!device || t.device == *device, name, " is on ", device_name(t.device), ", expected ",
            device_name(device.value_or(t.device)));
  MOP_CHECK(t.dtype == dtype, name, " has dtype ", dtype_name(t.dtype), ", expected ",
            dtype_name(dtype));
  bool same = t.ndim == int(dims.size());
  int i = 0;
  for (int64_t d : dims) same = same && t.shape[i++] == d;
  if (!same) {
    Tensor want(nullptr, dtype, dims);
    MOP_CHECK(false, name, " has shape ", t.shape_str(), ", expected ", want.shape_str());
  }
  MOP_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data");
}

std::unique_ptr<Ops> make_ops(Device device, int local_rank) {
  if (device == Device::CPU) return make_cpu_ops();
#ifdef MOP_HAVE_CUDA
  return make_cuda_ops(local_rank);
#else
  throw_user_error("train.device: cuda, but this mop was built without CUDA (MOP_CUDA=OFF)");
#endif
}

}  // namespace mop
