// read_small_file: stat, refuse what is not a regular file or is over the cap, then a bounded read.
#include "core/small_file.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

#include "core/error.h"

namespace mop {
namespace {

const char* file_kind(mode_t mode) {
  if (S_ISDIR(mode)) return "a directory";
  if (S_ISFIFO(mode)) return "a FIFO";
  if (S_ISCHR(mode)) return "a character device";
  if (S_ISBLK(mode)) return "a block device";
  if (S_ISSOCK(mode)) return "a socket";
  return "not a file";
}

void check_regular(const std::string& name, const struct stat& st) {
  MOP_USER_CHECK(S_ISREG(st.st_mode), name, ": is not a regular file (", file_kind(st.st_mode),
                 ")");
}

[[noreturn]] void over_cap(const std::string& name, uint64_t bytes, uint64_t cap, bool grew) {
  throw_user_error(name, ": ", grew ? "more than " : "", size_str(bytes), ", over the ",
                   size_str(cap), " cap for this file (is it the file you meant?)");
}

std::string label(const std::filesystem::path& path, std::string_view what) {
  return what.empty() ? path.string() : std::string(what) + " " + path.string();
}

}  // namespace

std::string size_str(uint64_t bytes) {
  if (bytes < kMiB) return std::to_string(bytes) + " bytes";
  char buf[64];
  if (bytes % kMiB == 0)
    std::snprintf(buf, sizeof buf, "%llu MiB", (unsigned long long)(bytes / kMiB));
  else
    std::snprintf(buf, sizeof buf, "%.1f MiB (%llu bytes)", double(bytes) / double(kMiB),
                  (unsigned long long)bytes);
  return buf;
}

uint64_t regular_file_size(const std::filesystem::path& path, std::string_view what) {
  const std::string name = label(path, what);
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    const int err = errno;
    MOP_USER_CHECK(err != ENOENT && err != ENOTDIR, name, ": not found");
    throw_user_error(name, ": cannot stat: ", std::strerror(err));
  }
  check_regular(name, st);
  return uint64_t(st.st_size);
}

std::string read_small_file(const std::filesystem::path& path, std::string_view what,
                            uint64_t cap) {
  const std::string name = label(path, what);
  const uint64_t size = regular_file_size(path, what);
  if (size > cap) over_cap(name, size, cap, false);
  // O_NONBLOCK: should the path become a FIFO after the stat, open returns instead of waiting
  // for a writer; fstat then refuses it. It changes nothing for a regular file.
  const int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw_user_error(name, ": cannot open: ", std::strerror(errno));
  std::string out;
  try {
    struct stat st {};
    if (::fstat(fd, &st) != 0) throw_user_error(name, ": cannot stat: ", std::strerror(errno));
    check_regular(name, st);
    out.reserve(size_t(std::min<uint64_t>(uint64_t(st.st_size), cap)));
    // Read to the end, but never past cap + 1 bytes: a file that grows while it is read, or one
    // whose size stat does not know (/proc), cannot make the read unbounded.
    char buf[1 << 16];
    for (;;) {
      const size_t want = std::min<uint64_t>(sizeof buf, cap + 1 - out.size());
      const ssize_t n = ::read(fd, buf, want);
      if (n < 0 && errno == EINTR) continue;
      if (n < 0) throw_user_error(name, ": read failed: ", std::strerror(errno));
      if (n == 0) break;
      out.append(buf, size_t(n));
      if (out.size() > cap) over_cap(name, cap, cap, true);
    }
  } catch (...) {
    ::close(fd);
    throw;
  }
  ::close(fd);
  return out;
}

}  // namespace mop
