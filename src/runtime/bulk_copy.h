// BulkCopier: copies of many gigabytes between pageable host memory and memory of any kind — a
// growth boundary's whole state (train/growth.h), a checkpoint's tensors on their way to the
// device — at the bus's rate rather than the pageable path's. A side on the device goes through
// two pinned bounce buffers, one filling while the other drains; the host side's memcpy is split
// over a thread pool, so the first touches of fresh pages are spread over the cores as well.
// Host to host: the pool's memcpy alone. Synchronous: the copy is done when copy() returns.
#pragma once

#include <cstddef>
#include <memory>
#include <vector>

#include "core/tensor.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace mop {

class ThreadPool;

class BulkCopier {
 public:
  // `threads` host threads (≤ 0: one per CPU this process may run on).
  explicit BulkCopier(int threads = 0);
  ~BulkCopier();
  BulkCopier(const BulkCopier&) = delete;
  BulkCopier& operator=(const BulkCopier&) = delete;

  // dst ← src, `bytes` bytes; each side is host memory (pageable or pinned) or, as `*_device`
  // says, device memory of the current GPU.
  void copy(void* dst, bool dst_device, const void* src, bool src_device, size_t bytes);
  // The same for tensors of equal size in bytes, each side where its tensor's device says.
  void copy(Tensor dst, const Tensor& src);

 private:
  void host_copy(void* dst, const void* src, size_t bytes);
  void ensure_stream();
  void ensure_bounce();  // the pinned buffers, for copies between host and device

  std::unique_ptr<ThreadPool> pool_;
  Buffer bounce_[2];
  OwnedStream stream_;
  Event filled_[2];
};

// std::vector's allocator that leaves new elements uninitialised: resize() does not touch the
// pages, a parallel copy (BulkCopier) touches them first.
template <class T>
struct UninitAllocator : std::allocator<T> {
  template <class U>
  struct rebind {
    using other = UninitAllocator<U>;
  };
  UninitAllocator() = default;
  template <class U>
  UninitAllocator(const UninitAllocator<U>&) noexcept {}
  template <class U>
  void construct(U* p) noexcept {
    ::new (static_cast<void*>(p)) U;
  }
  template <class U, class... Args>
  void construct(U* p, Args&&... args) {
    ::new (static_cast<void*>(p)) U(std::forward<Args>(args)...);
  }
};
using HostFloats = std::vector<float, UninitAllocator<float>>;

}  // namespace mop
