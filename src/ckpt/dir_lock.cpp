// The checkpoint directory's lock (see dir_lock.h).
#include "ckpt/dir_lock.h"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>

#include <spdlog/spdlog.h>

#include "core/error.h"

namespace mop {

namespace {

std::string read_all(int fd) {
  std::string out;
  char buf[256];
  ::lseek(fd, 0, SEEK_SET);
  for (ssize_t n; (n = ::read(fd, buf, sizeof buf)) > 0;) out.append(buf, size_t(n));
  while (!out.empty() && (out.back() == '\n' || out.back() == '\r')) out.pop_back();
  return out;
}

std::string host_name() {
  char buf[256] = {};
  if (::gethostname(buf, sizeof buf - 1) != 0) return "?";
  return buf;
}

}  // namespace

DirLock DirLock::acquire(const std::string& dir) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MOP_USER_CHECK(!ec, "checkpoint.dir: cannot create ", dir, ": ", ec.message());
  DirLock lock;
  lock.path_ = (std::filesystem::path(dir) / ".lock").string();
  lock.fd_ = ::open(lock.path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  MOP_USER_CHECK(lock.fd_ >= 0, "checkpoint.dir: cannot open ", lock.path_, ": ", std::strerror(errno));
  const std::string previous = read_all(lock.fd_);
  if (::flock(lock.fd_, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    if (err == EWOULDBLOCK) {
      ::close(lock.fd_);
      lock.fd_ = -1;
      throw_user_error("checkpoint.dir ", dir, " is in use by another run (",
                       previous.empty() ? std::string("owner unknown") : previous,
                       "); give this run a checkpoint.dir of its own, or stop that run first");
    }
    // A file system without advisory locks: run unguarded rather than not at all.
    spdlog::warn("checkpoint.dir {}: cannot lock {} ({}); nothing stops a second run from using "
                 "this directory", dir, lock.path_, std::strerror(err));
  }
  if (!previous.empty())
    spdlog::warn("checkpoint.dir {}: taking over the lock of a run that is gone ({})", dir, previous);
  const std::string me = "host " + host_name() + " pid " + std::to_string(::getpid()) + "\n";
  MOP_USER_CHECK(::ftruncate(lock.fd_, 0) == 0 && ::pwrite(lock.fd_, me.data(), me.size(), 0) == ssize_t(me.size()),
                 "checkpoint.dir: cannot write ", lock.path_, ": ", std::strerror(errno));
  return lock;
}

void DirLock::release() {
  if (fd_ < 0) return;
  // Empty the file before the lock goes: a lock file with content is a run that did not finish.
  if (::ftruncate(fd_, 0) != 0) spdlog::warn("cannot clear {}", path_);
  ::flock(fd_, LOCK_UN);
  ::close(fd_);
  fd_ = -1;
}

DirLock::~DirLock() { release(); }

DirLock& DirLock::operator=(DirLock&& o) noexcept {
  if (this != &o) {
    release();
    fd_ = o.fd_, path_ = std::move(o.path_);
    o.fd_ = -1;
  }
  return *this;
}

}  // namespace mop
