// Tensor: a non-owning view of a contiguous row-major array (≤ 4 dims) on one device.
// Memory is owned by arenas and parameter stores; ops receive views. Views are cheap to copy.
#pragma once

#include <array>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/dtype.h"
#include "core/error.h"

namespace mop {

enum class Device : uint8_t { CPU, CUDA };

constexpr std::string_view device_name(Device d) { return d == Device::CPU ? "cpu" : "cuda"; }

struct Tensor {
  static constexpr int kMaxDims = 4;

  void* data = nullptr;
  DType dtype = DType::F32;
  Device device = Device::CPU;
  int ndim = 0;
  std::array<int64_t, kMaxDims> shape{};

  Tensor() = default;
  Tensor(void* data_, DType dtype_, std::initializer_list<int64_t> dims, Device device_ = Device::CPU)
      : data(data_), dtype(dtype_), device(device_) {
    MOP_CHECK(dims.size() <= kMaxDims, "too many dims: ", dims.size());
    for (int64_t d : dims) {
      MOP_CHECK(d >= 0, "negative dim ", d);
      shape[ndim++] = d;
    }
  }

  bool defined() const { return data != nullptr || numel() == 0; }
  int64_t numel() const {
    int64_t n = 1;
    for (int i = 0; i < ndim; ++i) n *= shape[i];
    return n;
  }
  size_t bytes() const { return size_t(numel()) * dtype_size(dtype); }
  int64_t size(int dim) const {
    if (dim < 0) dim += ndim;
    MOP_CHECK(dim >= 0 && dim < ndim, "dim ", dim, " of a ", ndim, "-d tensor");
    return shape[dim];
  }
  // Elements per index of dim 0 (a "row"); well defined for zero rows too.
  int64_t row_numel() const {
    int64_t n = 1;
    for (int i = 1; i < ndim; ++i) n *= shape[i];
    return n;
  }

  template <class T>
  T* ptr() const {
    return static_cast<T*>(data);
  }

  // Same memory, new shape with the same number of elements.
  Tensor view(std::initializer_list<int64_t> dims) const {
    Tensor t(data, dtype, dims, device);
    MOP_CHECK(t.numel() == numel(), "view ", t.shape_str(), " of ", shape_str());
    return t;
  }

  // Rows [begin, end) along dim 0.
  Tensor rows(int64_t begin, int64_t end) const {
    MOP_CHECK(ndim >= 1 && 0 <= begin && begin <= end && end <= shape[0], "rows [", begin, ",", end,
              ") of ", shape_str());
    Tensor t = *this;
    t.shape[0] = end - begin;
    t.data = static_cast<char*>(data) + size_t(begin) * size_t(row_numel()) * dtype_size(dtype);
    return t;
  }

  // Sub-tensor at index i of dim 0 (drops that dim).
  Tensor at(int64_t i) const {
    Tensor r = rows(i, i + 1);
    for (int d = 1; d < ndim; ++d) r.shape[d - 1] = shape[d];
    r.shape[ndim - 1] = 0;
    r.ndim = ndim - 1;
    return r;
  }

  std::string shape_str() const;
};

// Whether two tensors' bytes overlap (empty tensors overlap nothing).
inline bool overlap(const Tensor& a, const Tensor& b) {
  const char *pa = static_cast<const char*>(a.data), *pb = static_cast<const char*>(b.data);
  return a.numel() > 0 && b.numel() > 0 && pa < pb + b.bytes() && pb < pa + a.bytes();
}

// "[d0,d1,…]": how messages print a shape.
inline std::string shape_str(const int64_t* dims, size_t n) {
  std::string s = "[";
  for (size_t i = 0; i < n; ++i) {
    if (i) s.push_back(',');
    s.append(std::to_string(dims[i]));
  }
  s.push_back(']');
  return s;
}
inline std::string shape_str(const std::vector<int64_t>& dims) { return shape_str(dims.data(), dims.size()); }
inline std::string Tensor::shape_str() const { return mop::shape_str(shape.data(), size_t(ndim)); }

// Shape comparison for preconditions: MOP_CHECK(same_shape(a, b), ...).
inline bool same_shape(const Tensor& a, const Tensor& b) {
  if (a.ndim != b.ndim) return false;
  for (int i = 0; i < a.ndim; ++i)
    if (a.shape[i] != b.shape[i]) return false;
  return true;
}

}  // namespace mop
