// Helpers for [gpu] tests: device tensors that own their memory, upload/download of HostTensors,
// output poisoning, and the pattern "run the CPU reference on bf16-rounded inputs, run the GPU op,
// compare with a named tolerance". Only compiled with MOP_HAVE_CUDA.
#pragma once

#ifdef MOP_HAVE_CUDA

#include <cuda_runtime.h>

#include <cstring>

#include "runtime/cuda_check.h"
#include "runtime/memory.h"
#include "ops/cuda_ops.h"
#include "test_util.h"

// Returns from a [gpu] test case, with a warning, where no CUDA device is.
#define MOP_REQUIRE_GPU()              \
  do {                                 \
    if (!gpu_available()) {            \
      WARN("no CUDA device: skipped"); \
      return;                          \
    }                                  \
  } while (0)

namespace mop::test {

// A device tensor with its own allocation.
struct DeviceTensor {
  Buffer buf;
  Tensor t;
  DeviceTensor() = default;
  DeviceTensor(DType dtype, std::initializer_list<int64_t> dims) {
    t = Tensor(nullptr, dtype, dims, Device::CUDA);
    buf = Buffer(MemKind::Device, std::max<size_t>(t.bytes(), 1));
    t.data = buf.data();
  }
  operator Tensor() const { return t; }
  int64_t numel() const { return t.numel(); }
};

// Same shape and dtype on the device, contents copied (dtype conversion through `ops` if asked).
inline DeviceTensor upload(const HostTensor& h, DType dtype) {
  DeviceTensor d;
  d.t = h.t;
  d.t.dtype = dtype;
  d.t.device = Device::CUDA;
  d.buf = Buffer(MemKind::Device, std::max<size_t>(d.t.bytes(), 1));
  d.t.data = d.buf.data();
  if (dtype == h.t.dtype) {
    MOP_CUDA_CHECK(cudaMemcpy(d.t.data, h.t.data, h.t.bytes(), cudaMemcpyHostToDevice));
  } else {
    HostTensor conv(dtype, {h.numel()});
    make_cpu_ops()->copy(conv.t, h.t.view({h.numel()}));
    MOP_CUDA_CHECK(cudaMemcpy(d.t.data, conv.t.data, d.t.bytes(), cudaMemcpyHostToDevice));
  }
  MOP_CUDA_CHECK(cudaDeviceSynchronize());  // the ops' non-blocking stream does not wait for it
  return d;
}
inline DeviceTensor upload(const HostTensor& h) { return upload(h, h.t.dtype); }

// A host copy of a device tensor (same dtype).
inline HostTensor download(const Tensor& d) {
  HostTensor h(d.dtype, {d.numel()});
  h.t = Tensor(h.storage.data(), d.dtype, {}, Device::CPU);
  h.t.ndim = d.ndim;
  h.t.shape = d.shape;
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
  MOP_CUDA_CHECK(cudaMemcpy(h.t.data, d.data, d.bytes(), cudaMemcpyDeviceToHost));
  return h;
}

// Fill a device buffer with 0xFF bytes (NaN in every float type, -1 in ints) before an op writes
// it, so elements an op forgets to write are caught.
inline void poison(const Tensor& d) {
  MOP_CUDA_CHECK(cudaMemset(d.data, 0xFF, d.bytes()));
  MOP_CUDA_CHECK(cudaDeviceSynchronize());  // the ops' non-blocking stream does not wait for it
}

// A host tensor with the same values rounded to bf16 and held as f32 (the reference's input).
inline HostTensor bf16_rounded_f32(const HostTensor& h) {
  HostTensor r(DType::F32, {h.numel()});
  r.t.ndim = h.t.ndim;
  r.t.shape = h.t.shape;
  for (int64_t i = 0; i < h.numel(); ++i) r.set(i, round_bf16(float(h.get(i))));
  return r;
}

// Count of elements where |a − ref| > atol + rtol·|ref| (NaN counts as wrong).
inline int64_t count_mismatches(const HostTensor& a, const HostTensor& ref, double atol, double rtol) {
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    double x = a.get(i), y = ref.get(i);
    if (!(std::fabs(x - y) <= atol + rtol * std::fabs(y))) ++bad;
  }
  return bad;
}

}  // namespace mop::test

#endif  // MOP_HAVE_CUDA
