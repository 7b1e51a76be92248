// The front's shared pieces (see ops.h): the argument checks, the op table and the backend
// factory. Each op's front method is in its stem's file (src/ops/<stem>.cpp).
#include "ops/ops.h"

#include <string>

#include "core/error.h"

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

const char* op_category_name(OpCategory c) {
  switch (c) {
    case OpCategory::Attention: return "attention";
    case OpCategory::DenseGemm: return "dense GEMMs";
    case OpCategory::Experts: return "experts";
    case OpCategory::RouterPermute: return "router/permute";
    case OpCategory::Loss: return "LM head+loss";
    case OpCategory::Optimizer: return "optimizer";
    case OpCategory::Communication: return "communication";
    case OpCategory::Other: return "other";
  }
  return "?";
}

namespace {
const OpInfo kOps[] = {
#define MOP_OP(name, category, params, args) {#name, OpCategory::category},
#include "ops/op_list.inc"
#undef MOP_OP
};
}  // namespace

const OpInfo& op_info(OpId id) { return kOps[size_t(id)]; }

Ops::Ops(std::shared_ptr<OpsBackend> backend)
    : backend_(std::move(backend)),
      device_(backend_->device()),
      compute_dtypes_(backend_->compute_dtypes()) {}

Ops::~Ops() = default;

DType Ops::compute_dtype(const Tensor& t, const char* name) const {
  std::string names;
  for (DType d : compute_dtypes_) {
    if (t.dtype == d) return d;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(d));
  }
  MOP_CHECK(false, name, " has dtype ", dtype_name(t.dtype), "; the ", device_name(device_),
            " backend computes in ", names);
  return t.dtype;
}

DType Ops::acc_dtype_of(const Tensor& t, const char* name) const {
  std::string names;
  for (DType d : compute_dtypes_) {
    if (t.dtype == acc_dtype(d)) return t.dtype;
    names += (names.empty() ? "" : " or ") + std::string(dtype_name(acc_dtype(d)));
  }
  MOP_CHECK(false, name, " has dtype ", dtype_name(t.dtype), ", expected ", names);
  return t.dtype;
}

void Ops::expect(const Tensor& t, const char* name, DType dtype,
                 std::initializer_list<int64_t> dims, bool host_ok) const {
  const bool on_host = host_ok && t.device == Device::CPU;
  expect_tensor(t, name, on_host ? Device::CPU : device_, dtype, dims);
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
