// POSIX file helpers: every system call checked, errors reported with the path and strerror.
#include "ckpt/file_io.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "core/error.h"

namespace mop {
namespace {

[[noreturn]] void fail_errno(const std::filesystem::path& path, std::string_view what, int err) {
  throw_user_error(path.string(), ": ", what, ": ", std::strerror(err));
}

// write(2) moves at most ~2 GiB per call on Linux; larger requests are split.
constexpr size_t kMaxWrite = size_t(1) << 30;

}  // namespace

OutFile::OutFile(const std::filesystem::path& path) : path_(path) {
  fd_ = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
  if (fd_ < 0) fail_errno(path_, "cannot create", errno);
}

OutFile::~OutFile() {
  if (fd_ >= 0) ::close(fd_);
}

void OutFile::write(const void* data, size_t bytes) {
  MOP_CHECK(fd_ >= 0, path_.string(), ": write after close");
  const char* p = static_cast<const char*>(data);
  while (bytes > 0) {
    ssize_t n = ::write(fd_, p, std::min(bytes, kMaxWrite));
    if (n < 0) {
      if (errno == EINTR) continue;
      fail_errno(path_, "write failed", errno);
    }
    p += n;
    bytes -= size_t(n);
    bytes_written_ += uint64_t(n);
  }
}

void OutFile::sync_and_close() {
  MOP_CHECK(fd_ >= 0, path_.string(), ": closed twice");
  int fd = fd_;
  fd_ = -1;
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    fail_errno(path_, "fsync failed", err);
  }
  // close() can report a deferred write error (e.g. on NFS); it is not retried (the fd is gone).
  if (::close(fd) != 0) fail_errno(path_, "close failed", errno);
}

void write_file_durable(const std::filesystem::path& path, std::string_view content) {
  OutFile f(path);
  f.write(content);
  f.sync_and_close();
}

void write_file_atomic(const std::filesystem::path& path, std::string_view content) {
  std::filesystem::path tmp = path;
  tmp += ".tmp";
  write_file_durable(tmp, content);
  rename_path(tmp, path);
  fsync_path(path.has_parent_path() ? path.parent_path() : std::filesystem::path("."));
}

void fsync_path(const std::filesystem::path& path) {
  // O_RDONLY works for directories and files alike; fsync needs no write access on Linux.
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
  if (fd < 0) fail_errno(path, "cannot open for fsync", errno);
  if (::fsync(fd) != 0) {
    int err = errno;
    ::close(fd);
    fail_errno(path, "fsync failed", err);
  }
  ::close(fd);
}

void rename_path(const std::filesystem::path& from, const std::filesystem::path& to) {
  if (::rename(from.c_str(), to.c_str()) != 0)
    throw_user_error("cannot rename ", from.string(), " to ", to.string(), ": ",
                     std::strerror(errno));
}

}  // namespace mop
