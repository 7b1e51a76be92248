// Owned memory: Buffer (one allocation on a device, or pinned host memory) and Arena, which lays
// out many tensors in one Buffer. Sizes are planned before the first step; nothing in the step loop
// allocates. Offsets are aligned to kArenaAlign bytes (vector loads, TMA and cuBLASLt alignment).
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mop {

enum class MemKind : uint8_t { Host, Pinned, Device };

constexpr size_t kArenaAlign = 256;
constexpr size_t align_up(size_t n, size_t a = kArenaAlign) { return (n + a - 1) / a * a; }

class Buffer {
 public:
  Buffer() = default;
  Buffer(MemKind kind, size_t bytes);
  ~Buffer();
  Buffer(Buffer&& o) noexcept { *this = std::move(o); }
  Buffer& operator=(Buffer&& o) noexcept;
  Buffer(const Buffer&) = delete;
  Buffer& operator=(const Buffer&) = delete;

  void* data() const { return data_; }
  size_t bytes() const { return bytes_; }
  MemKind kind() const { return kind_; }
  Device device() const { return kind_ == MemKind::Device ? Device::CUDA : Device::CPU; }

 private:
  void release();
  void* data_ = nullptr;
  size_t bytes_ = 0;
  MemKind kind_ = MemKind::Host;
};

// Two phases: add() tensors (returns a slot), then allocate() once, then tensor(slot).
class Arena {
 public:
  explicit Arena(MemKind kind, std::string name) : kind_(kind), name_(std::move(name)) {}

  int add(DType dtype, std::initializer_list<int64_t> dims);
  int add(const Tensor& shape);  // the dtype and dims of `shape` (its data is ignored)
  // A slot in the bytes of slot `within` (added before or after) from byte `offset`: for buffers
  // whose lifetimes never overlap. It adds nothing to the arena; allocate() checks that it fits.
  int add_view(int within, size_t offset, const Tensor& shape);
  void allocate();  // zero-filled
  Tensor tensor(int slot) const;
  size_t planned_bytes() const { return total_; }
  const std::string& name() const { return name_; }
  bool allocated() const { return buffer_.data() != nullptr || total_ == 0; }

 private:
  struct Slot {
    size_t offset;  // in the buffer, or in slot `within`'s bytes
    Tensor shape;   // data unset until allocate()
    int within = -1;
  };
  MemKind kind_;
  std::string name_;
  std::vector<Slot> slots_;
  size_t total_ = 0;
  Buffer buffer_;
};

// Human-readable byte counts: "1.50 GiB".
std::string format_bytes(double bytes);

}  // namespace mop
