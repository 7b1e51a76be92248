// SHA-256 (FIPS 180-4): incremental hashing, hex digests, and a streaming file hash. Checkpoint
// manifests record each file's digest so a resume can prove its inputs are the bytes written.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace mop {

class Sha256 {
 public:
  using Digest = std::array<uint8_t, 32>;

  Sha256();
  void update(const void* data, size_t bytes);
  void update(std::string_view s) { update(s.data(), s.size()); }
  // Pads and returns the digest; the object must not be updated afterwards (it may be reset()).
  Digest finish();
  std::string finish_hex();
  void reset();
  uint64_t bytes_hashed() const { return total_bytes_; }

 private:
  void compress(const uint8_t* block);

  std::array<uint32_t, 8> h_;
  std::array<uint8_t, 64> buf_;
  size_t buf_len_ = 0;
  uint64_t total_bytes_ = 0;
  bool finished_ = false;
};

// A file's size and lower-case hex SHA-256, as recorded in checkpoint manifests.
struct FileDigest {
  uint64_t bytes = 0;
  std::string sha256;
};

// Lower-case hex, two characters per byte.
std::string to_hex(const uint8_t* bytes, size_t n);
std::string sha256_hex(std::string_view data);
// Streams the file in large blocks.
FileDigest sha256_file(const std::filesystem::path& path);

}  // namespace mop
