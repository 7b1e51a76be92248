// MappedFile: a read-only memory map of a whole file (RAII, move-only).
// Token shards, Megatron indexes and safetensors files are read through it, so the page cache,
// not the process heap, holds the data, and every rank on a host shares one copy.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace mop {

// Access pattern hints passed to madvise(); they change performance, never results.
enum class MapAdvice { Normal, Sequential, Random, WillNeed };

class MappedFile {
 public:
  MappedFile() = default;
  // Maps `path` read-only. Missing, unreadable or non-regular files are a UserError naming the
  // path.
  explicit MappedFile(std::string path, MapAdvice advice = MapAdvice::Normal);
  ~MappedFile();
  MappedFile(MappedFile&& other) noexcept;
  MappedFile& operator=(MappedFile&& other) noexcept;
  MappedFile(const MappedFile&) = delete;
  MappedFile& operator=(const MappedFile&) = delete;

  const std::string& path() const { return path_; }
  // Null for an empty file (a zero-length mapping is not allowed).
  const uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  // Re-hints the whole mapping (e.g. Sequential for a full scan). Thread-safe; a hint only.
  void advise(MapAdvice advice) const;

 private:
  void release();

  std::string path_;
  const uint8_t* data_ = nullptr;
  size_t size_ = 0;
};

}  // namespace mop
