// BulkCopier (runtime/bulk_copy.h): host to host through the thread pool, and host → device →
// host through the pinned bounce buffers, byte for byte, for sizes around its piece and chunk
// boundaries (256 KiB pieces, 64 MiB bounce buffers) and into uninitialised HostFloats.
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>

#include "catch.h"
#include "runtime/bulk_copy.h"
#include "runtime/memory.h"
#include "test_util.h"

using namespace mop;

namespace {

std::vector<uint8_t> pattern(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t x = seed;
  for (size_t i = 0; i < n; ++i) {
    x = x * 1664525u + 1013904223u;
    v[i] = uint8_t(x >> 24);
  }
  return v;
}

}  // namespace

TEST_CASE("bulk copy: host to host, every size around a piece, on 1 and 3 threads", "[cpu][core]") {
  for (int threads : {1, 3}) {
    BulkCopier copier(threads);
    for (size_t n : {size_t(0), size_t(1), size_t(512u << 10) - 1, size_t(512u << 10), size_t(512u << 10) + 3,
                     size_t(37u << 20) + 5}) {
      INFO(threads << " threads, " << n << " bytes");
      const std::vector<uint8_t> src = pattern(n, uint32_t(n) + 1);
      std::vector<uint8_t> dst(n + 2, 0xAB);
      copier.copy(dst.data() + 1, false, src.data(), false, n);
      CHECK(std::equal(src.begin(), src.end(), dst.begin() + 1));
      CHECK(dst.front() == 0xAB);  // nothing written outside
      CHECK(dst.back() == 0xAB);
    }
  }
  // Into a HostFloats that was never written (its pages are touched by the copy).
  const std::vector<uint8_t> src = pattern(size_t(9u << 20), 7);
  HostFloats f(src.size() / sizeof(float));
  BulkCopier(2).copy(f.data(), false, src.data(), false, src.size());
  CHECK(std::memcmp(f.data(), src.data(), src.size()) == 0);
}

TEST_CASE("bulk copy: through the bounce buffers, host → device → host", "[gpu]") {
  BulkCopier copier;
  for (size_t n : {size_t(1), size_t(64u << 20), size_t(64u << 20) + 1, size_t(150u << 20) + 12}) {
    INFO(n << " bytes");
    const std::vector<uint8_t> src = pattern(n, uint32_t(n));
    Buffer dev(MemKind::Device, n), dev2(MemKind::Device, n);
    copier.copy(dev.data(), true, src.data(), false, n);
    copier.copy(dev2.data(), true, dev.data(), true, n);
    std::vector<uint8_t> back(n, 0);
    copier.copy(back.data(), false, dev2.data(), true, n);
    CHECK(back == src);
  }
}
