// Buffer and Arena. The memory itself comes from the runtime (runtime/runtime.h).
#include "runtime/memory.h"

#include <cstdio>

#include "runtime/runtime.h"

namespace mop {

Buffer::Buffer(MemKind kind, size_t bytes) : bytes_(bytes), kind_(kind) {
  data_ = allocate_memory(kind, bytes);
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
  release_memory(kind_, data_);
  data_ = nullptr;
  bytes_ = 0;
}

int Arena::add(DType dtype, std::initializer_list<int64_t> dims) {
  return add(Tensor(nullptr, dtype, dims));
}

int Arena::add(const Tensor& shape) {
  MOP_CHECK(!buffer_.data(), "arena ", name_, " is already allocated");
  Tensor t = shape;
  t.data = nullptr;
  t.device = kind_ == MemKind::Device ? Device::CUDA : Device::CPU;
  slots_.push_back({total_, t});
  total_ += align_up(t.bytes());
  return int(slots_.size()) - 1;
}

int Arena::add_view(int within, size_t offset, const Tensor& shape) {
  MOP_CHECK(!buffer_.data(), "arena ", name_, " is already allocated");
  MOP_CHECK(offset % kArenaAlign == 0, "arena ", name_, ": view offset ", offset, " is not aligned");
  Tensor t = shape;
  t.data = nullptr;
  t.device = kind_ == MemKind::Device ? Device::CUDA : Device::CPU;
  slots_.push_back({offset, t, within});
  return int(slots_.size()) - 1;
}

void Arena::allocate() {
  MOP_CHECK(!buffer_.data(), "arena ", name_, " allocated twice");
  for (const Slot& s : slots_) {
    if (s.within < 0) continue;
    MOP_CHECK(s.within < int(slots_.size()) && slots_[size_t(s.within)].within < 0 &&
                  s.offset + s.shape.bytes() <= slots_[size_t(s.within)].shape.bytes(),
              "arena ", name_, ": a view of ", s.shape.bytes(), " bytes at ", s.offset,
              " does not fit in slot ", s.within);
  }
  buffer_ = Buffer(kind_, total_);
}

Tensor Arena::tensor(int slot) const {
  MOP_CHECK(slot >= 0 && size_t(slot) < slots_.size(), "arena ", name_, ": bad slot ", slot);
  MOP_CHECK(allocated(), "arena ", name_, " used before allocate()");
  const Slot& s = slots_[size_t(slot)];
  const size_t base = s.within < 0 ? 0 : slots_[size_t(s.within)].offset;
  Tensor t = s.shape;
  t.data = static_cast<char*>(buffer_.data()) + base + s.offset;
  return t;
}

std::string format_bytes(double bytes) {
  if (bytes < 0) return "-" + format_bytes(-bytes);
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
