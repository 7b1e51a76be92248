// BulkCopier (see bulk_copy.h).
#include "runtime/bulk_copy.h"

#include <algorithm>
#include <cstring>

#include "core/error.h"
#include "core/thread_pool.h"

namespace mop {

namespace {

constexpr size_t kBounceBytes = size_t(64) << 20;  // per bounce buffer
constexpr size_t kPieceBytes = size_t(256) << 10;  // a pool thread's claim of a host copy: a 6 MB
                                                   // expert matrix spreads over 16 threads

}  // namespace

BulkCopier::BulkCopier(int threads) {
  // One thread per allowed CPU, as the host optimizer's pool: with `--bind-to none` every rank of
  // a node pins its threads over all the node's CPUs, so ranks copying at once spread over them.
  pool_ = std::make_unique<ThreadPool>(threads, allowed_cpus());
}

BulkCopier::~BulkCopier() = default;

void BulkCopier::host_copy(void* dst, const void* src, size_t bytes) {
  if (bytes < 2 * kPieceBytes || pool_->num_threads() < 2) {
    std::memcpy(dst, src, bytes);
    return;
  }
  char* d = static_cast<char*>(dst);
  const char* s = static_cast<const char*>(src);
  const int64_t pieces = int64_t((bytes + kPieceBytes - 1) / kPieceBytes);
  pool_->run(pieces, 1, [&](int64_t b, int64_t e) {
    for (int64_t i = b; i < e; ++i) {
      const size_t at = size_t(i) * kPieceBytes;
      std::memcpy(d + at, s + at, std::min(kPieceBytes, bytes - at));
    }
  });
}

void BulkCopier::ensure_stream() {
  if (stream_.get().is_null()) stream_ = OwnedStream(Device::CUDA);
}

void BulkCopier::ensure_bounce() {
  if (bounce_[0].data()) return;
  for (int i = 0; i < 2; ++i) {
    bounce_[i] = Buffer(MemKind::Pinned, kBounceBytes);
    filled_[i] = Event(Device::CUDA);
  }
}

void BulkCopier::copy(void* dst, bool dst_device, const void* src, bool src_device, size_t bytes) {
  if (bytes == 0 || dst == src) return;
  if (!dst_device && !src_device) {
    host_copy(dst, src, bytes);
    return;
  }
  ensure_stream();
  const Stream s = stream_.get();
  if (dst_device && src_device) {  // no bounce buffers needed
    copy_async(dst, src, bytes, s);
    s.synchronize();
    return;
  }
  ensure_bounce();
  char* d = static_cast<char*>(dst);
  const char* from = static_cast<const char*>(src);
  const size_t chunks = (bytes + kBounceBytes - 1) / kBounceBytes;
  auto size_of = [&](size_t i) { return std::min(kBounceBytes, bytes - i * kBounceBytes); };
  auto bounce = [&](size_t i) { return static_cast<char*>(bounce_[i % 2].data()); };
  if (src_device) {
    // Device → host: chunk i + 1 lands in one bounce buffer while chunk i leaves the other.
    auto fetch = [&](size_t i) {
      copy_async(bounce(i), from + i * kBounceBytes, size_of(i), s);
      filled_[i % 2].record(s);
    };
    fetch(0);
    for (size_t i = 0; i < chunks; ++i) {
      if (i + 1 < chunks) fetch(i + 1);
      filled_[i % 2].synchronize();
      host_copy(d + i * kBounceBytes, bounce(i), size_of(i));
    }
    return;
  }
  // Host → device: a bounce buffer is refilled once its last upload has finished.
  for (size_t i = 0; i < chunks; ++i) {
    if (i >= 2) filled_[i % 2].synchronize();
    host_copy(bounce(i), from + i * kBounceBytes, size_of(i));
    copy_async(d + i * kBounceBytes, bounce(i), size_of(i), s);
    filled_[i % 2].record(s);
  }
  s.synchronize();
}

void BulkCopier::copy(Tensor dst, const Tensor& src) {
  MOP_CHECK(dst.bytes() == src.bytes(), "BulkCopier: ", dst.shape_str(), " ← ", src.shape_str());
  copy(dst.data, dst.device != Device::CPU, src.data, src.device != Device::CPU, src.bytes());
}

}  // namespace mop
