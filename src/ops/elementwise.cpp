// Front of the elementwise and memory ops (fill, copy, add, sum, sumsq): their checks, then the
// backend's hooks (cpu/elementwise.cpp, cuda/elementwise.cpp, kernels/elementwise.cu).
#include <initializer_list>

#include "core/error.h"
#include "ops/ops.h"

namespace mop {
void Ops::fill(Tensor x, double value) {
  MOP_CHECK(x.device == device(), "fill: x is on ", device_name(x.device), ", expected ",
            device_name(device()));
  MOP_CHECK(x.data != nullptr || x.numel() == 0, "fill: x has no data");
  MOP_CHECK(dtype_is_float(x.dtype) || x.dtype == DType::I32, "fill: unsupported dtype ",
            dtype_name(x.dtype));
  run(OpId::fill, &OpsBackend::fill, x, value);
}

// Either side may be in host memory (the CPU backend's tensors all are).
void Ops::copy(Tensor dst, const Tensor& src) {
  for (const Tensor* t : std::initializer_list<const Tensor*>{&dst, &src})
    MOP_CHECK(t->device == device() || t->device == Device::CPU, "copy: a tensor on ",
              device_name(t->device), " given to the ", device_name(device()), " backend");
  MOP_CHECK(dst.numel() == src.numel(), "copy: dst ", dst.shape_str(), " and src ", src.shape_str(),
            " differ in size");
  MOP_CHECK((dst.data && src.data) || dst.numel() == 0, "copy: missing data");
  if (dst.dtype != src.dtype) {
    MOP_CHECK(dtype_is_float(dst.dtype) && dtype_is_float(src.dtype), "copy: no conversion from ",
              dtype_name(src.dtype), " to ", dtype_name(dst.dtype));
    // Converting in place would overwrite elements before they are read.
    MOP_CHECK(!overlap(dst, src), "copy: a converting copy cannot run in place");
  }
  run(OpId::copy, &OpsBackend::copy, dst, src);
}

void Ops::add(Tensor out, const Tensor& a, const Tensor& b) {
  MOP_CHECK(same_shape(a, b) && same_shape(a, out), "add: shapes ", out.shape_str(), " = ",
            a.shape_str(), " + ", b.shape_str());
  MOP_CHECK(dtype_is_float(a.dtype) && a.dtype == b.dtype && a.dtype == out.dtype, "add: dtypes ",
            dtype_name(out.dtype), " = ", dtype_name(a.dtype), " + ", dtype_name(b.dtype));
  for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &a, &b})
    MOP_CHECK(t->device == device() && (t->data || t->numel() == 0), "add: out, a and b must be ",
              device_name(device()), " tensors with data");
  run(OpId::add, &OpsBackend::add, out, a, b);
}

namespace {
void check_reduce_input(const Tensor& out, const Tensor& x, Device device, const char* op) {
  MOP_CHECK(x.device == device && out.device == device, op, ": x and out must be on ",
            device_name(device));
  MOP_CHECK(dtype_is_float(x.dtype), op, ": x has dtype ", dtype_name(x.dtype),
            ", expected f32, f64 or bf16");
  MOP_CHECK(x.data != nullptr || x.numel() == 0, op, ": x has no data");
}
}  // namespace

void Ops::sumsq(Tensor out, const Tensor& x) {
  check_reduce_input(out, x, device(), "sumsq");
  MOP_CHECK(out.dtype == DType::I64 && out.numel() == 4 && out.data,
            "sumsq: out must be i64 [4], is ", dtype_name(out.dtype), " ", out.shape_str());
  run(OpId::sumsq, &OpsBackend::sumsq, out, x);
}

void Ops::sum(Tensor out, const Tensor& x) {
  check_reduce_input(out, x, device(), "sum");
  MOP_CHECK(out.dtype == DType::F32 || out.dtype == DType::F64, "sum: out has dtype ",
            dtype_name(out.dtype), ", expected f32 or f64");
  MOP_CHECK(out.numel() == 1 && out.data, "sum: out must hold one element, has ", out.shape_str());
  run(OpId::sum, &OpsBackend::sum, out, x);
}

}  // namespace mop
