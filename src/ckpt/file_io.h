// POSIX file helpers for durable checkpoint writes: a streaming output file, fsync of files and
// directories, atomic replace (whole-file reads: core/small_file.h). Failures are UserErrors
// naming the path and the system's reason ("ckpt/step_40.tmp/model.safetensors: write failed: No
// space left on device"): paths, permissions and full disks are for the user to fix.
#pragma once

#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>

namespace mop {

// A file opened for writing (created or truncated, mode 0644). Destroying it without close()
// closes the descriptor and leaves the partial file (the caller decides whether to remove it).
class OutFile {
 public:
  explicit OutFile(const std::filesystem::path& path);
  ~OutFile();
  OutFile(const OutFile&) = delete;
  OutFile& operator=(const OutFile&) = delete;

  // Writes all bytes (retrying short writes and EINTR).
  void write(const void* data, size_t bytes);
  void write(std::string_view s) { write(s.data(), s.size()); }
  // fsync, then close: once this returns the data is on stable storage.
  void sync_and_close();

  uint64_t bytes_written() const { return bytes_written_; }
  const std::filesystem::path& path() const { return path_; }

 private:
  std::filesystem::path path_;
  int fd_ = -1;
  uint64_t bytes_written_ = 0;
};

// Writes, fsyncs and closes `path` (no rename: for files inside a not-yet-committed directory).
void write_file_durable(const std::filesystem::path& path, std::string_view content);
// Replaces `path` atomically: writes `path`.tmp, fsyncs it, renames it over `path`, fsyncs the
// directory. A reader sees the old content or the new, never a mix.
void write_file_atomic(const std::filesystem::path& path, std::string_view content);
// Flushes a file's data, or a directory's entries (so creates and renames in it survive a crash).
void fsync_path(const std::filesystem::path& path);
// rename(2): atomic within one file system; replaces an existing file or empty directory.
void rename_path(const std::filesystem::path& from, const std::filesystem::path& to);

}  // namespace mop
