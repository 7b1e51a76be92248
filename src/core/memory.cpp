// Buffer and Arena. Device and pinned memory go through the CUDA runtime when it is compiled in.
#include "core/memory.h"

#include <cstdio>
#include <cstdlib>
#include <cstring>

#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace mop {

Buffer::Buffer(MemKind kind, size_t bytes) : bytes_(bytes), kind_(kind) {
  if (bytes == 0) return;
  switch (kind) {
    case MemKind::Host:
      data_ = std::aligned_alloc(kArenaAlign, align_up(bytes));
      MOP_CHECK(data_, "host allocation of ", bytes, " bytes failed");
      std::memset(data_, 0, bytes);
      break;
#ifdef MOP_HAVE_CUDA
    case MemKind::Pinned: {
      cudaError_t e = cudaHostAlloc(&data_, bytes, cudaHostAllocDefault);
      MOP_CHECK(e == cudaSuccess, "cudaHostAlloc(", format_bytes(double(bytes)),
                "): ", cudaGetErrorString(e));
      std::memset(data_, 0, bytes);
      break;
    }
    case MemKind::Device: {
      cudaError_t e = cudaMalloc(&data_, bytes);
      MOP_CHECK(e == cudaSuccess, "cudaMalloc(", format_bytes(double(bytes)),
                "): ", cudaGetErrorString(e));
      e = cudaMemset(data_, 0, bytes);
      MOP_CHECK(e == cudaSuccess, "cudaMemset: ", cudaGetErrorString(e));
      // The memset runs on the legacy default stream, which the backend's non-blocking stream does
      // not wait for: finish it here (allocation happens before the step loop).
      e = cudaDeviceSynchronize();
      MOP_CHECK(e == cudaSuccess, "cudaDeviceSynchronize: ", cudaGetErrorString(e));
      break;
    }
#else
    case MemKind::Pinned:
    case MemKind::Device:
      MOP_CHECK(false, "this binary was built without CUDA (MOP_CUDA=OFF)");
#endif
  }
}

Buffer::~Buffer() { release(); }

Buffer& Buffer::operator=(Buffer&& o) noexcept {
  if (this != &o) {
    release();
    data_ = o.data_;
    bytes_ = o.bytes_;
    kind_ = o.kind_;
    o.data_ = nullptr;
    o.bytes_ = 0;
  }
  return *this;
}

void Buffer::release() {
  if (!data_) return;
  switch (kind_) {
    case MemKind::Host: std::free(data_); break;
#ifdef MOP_HAVE_CUDA
    case MemKind::Pinned: cudaFreeHost(data_); break;
    case MemKind::Device: cudaFree(data_); break;
#else
    default: break;
#endif
  }
  data_ = nullptr;
  bytes_ = 0;
}

int Arena::add(DType dtype, std::initializer_list<int64_t> dims) {
  MOP_CHECK(!buffer_.data(), "arena ", name_, " is already allocated");
  Tensor t(nullptr, dtype, dims, kind_ == MemKind::Device ? Device::CUDA : Device::CPU);
  slots_.push_back({total_, t});
  total_ += align_up(t.bytes());
  return int(slots_.size()) - 1;
}

void Arena::allocate() {
  MOP_CHECK(!buffer_.data(), "arena ", name_, " allocated twice");
  buffer_ = Buffer(kind_, total_);
}

Tensor Arena::tensor(int slot) const {
  MOP_CHECK(slot >= 0 && size_t(slot) < slots_.size(), "arena ", name_, ": bad slot ", slot);
  MOP_CHECK(allocated(), "arena ", name_, " used before allocate()");
  Tensor t = slots_[slot].shape;
  t.data = static_cast<char*>(buffer_.data()) + slots_[slot].offset;
  return t;
}

std::string format_bytes(double bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (bytes >= 1024.0 && u < 4) {
    bytes /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", bytes, units[u]);
  return buf;
}

}  // namespace mop
