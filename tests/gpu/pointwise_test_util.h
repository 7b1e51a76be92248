// Helpers shared by the [gpu][pointwise] tests and bench_pointwise.cpp (no Catch2 here): bf16-exact
// random inputs, uploads into aligned or deliberately misaligned device views, settle() (the
// uploads and poisoning of gpu_test_util.h run on the legacy default stream — cudaMemcpy from
// pageable memory and cudaMemset may return before the device is done — which CudaOps's
// non-blocking stream does not wait for), tolerance checks and bitwise comparison.
#pragma once

#ifdef MOP_HAVE_CUDA

#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>

#include "gpu/gpu_test_util.h"
#include "ops/ops_test_util.h"

namespace mop::test::pw {

// A bf16 result is its fp32 value rounded to nearest: at most half an ulp, 2^-8 relative.
constexpr double kBf16Rtol = 1.0 / 256;

inline void settle() {
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
}

// A CUDA build on a machine without a GPU runs an unfiltered mop_tests: these cases then pass
// with a note (`mop_tests "[gpu]"` exits 77 before any case runs).
inline bool skip_without_gpu() {
  if (gpu_available()) return false;
  std::fprintf(stderr, "no CUDA device: [gpu][pointwise] case skipped\n");
  return true;
}

inline Ops& cpu() {
  static std::unique_ptr<Ops> ops = make_cpu_ops();
  return *ops;
}

// f32 values uniform in [lo, hi), rounded through bf16 (exact in every float dtype).
inline HostTensor random_f32(std::initializer_list<int64_t> dims, uint64_t seed, double lo = -1,
                             double hi = 1) {
  HostTensor t(DType::F32, dims);
  fill_uniform(t, seed, lo, hi);
  return t;
}

// The same values in another dtype (exact for bf16-exact inputs), or a copy.
inline HostTensor as_dtype(const HostTensor& h, DType dtype) {
  HostTensor r(dtype, {h.numel()});
  r.t.ndim = h.t.ndim;
  r.t.shape = h.t.shape;
  make_cpu_ops()->copy(r.t.view({h.numel()}), h.t.view({h.numel()}));
  return r;
}

// A device copy of h in `dtype` whose data starts `offset` elements into its allocation, so
// offset 1 gives a view that is not 16-byte aligned (the kernels' scalar paths).
inline DeviceTensor upload_at(const HostTensor& h, DType dtype, int64_t offset = 0) {
  HostTensor conv = as_dtype(h, dtype);
  DeviceTensor d(dtype, {h.numel() + offset});
  d.t = conv.t;
  d.t.device = Device::CUDA;
  d.t.data = static_cast<char*>(d.buf.data()) + size_t(offset) * dtype_size(dtype);
  MOP_CUDA_CHECK(cudaMemcpy(d.t.data, conv.t.data, conv.t.bytes(), cudaMemcpyHostToDevice));
  settle();
  return d;
}

// An uninitialised (poisoned) device tensor, optionally offset like upload_at.
inline DeviceTensor poisoned(DType dtype, std::initializer_list<int64_t> dims, int64_t offset = 0) {
  Tensor shape(nullptr, dtype, dims);
  DeviceTensor d(dtype, {shape.numel() + offset});
  d.t = shape;
  d.t.device = Device::CUDA;
  d.t.data = static_cast<char*>(d.buf.data()) + size_t(offset) * dtype_size(dtype);
  poison(d.t);
  settle();
  return d;
}

inline std::string number(double x) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.9g", x);
  return buf;
}

// Elements where |got − ref| > atol + rtol·|ref| (NaN counts), and the first of them in `first`.
inline int64_t mismatches(const HostTensor& got, const HostTensor& ref, double atol, double rtol,
                          std::string* first = nullptr) {
  int64_t bad = 0;
  for (int64_t i = 0; i < ref.numel(); ++i) {
    const double g = got.get(i), r = ref.get(i);
    if (std::fabs(g - r) <= atol + rtol * std::fabs(r)) continue;
    if (bad++ == 0 && first)
      *first = "element " + std::to_string(i) + ": got " + number(g) + ", expected " + number(r);
  }
  return bad;
}

}  // namespace mop::test::pw

#endif  // MOP_HAVE_CUDA
