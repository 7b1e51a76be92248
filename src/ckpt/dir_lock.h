// Exclusive use of a checkpoint directory by one run: `<dir>/.lock` holds the owner's host and pid
// under an advisory lock (flock) that the kernel drops when the owner exits, however it exits. A
// second run on the same directory is refused, naming the owner; a lock file whose lock nobody
// holds (a run killed with -9) is taken over with a warning.
#pragma once

#include <string>

namespace mop {

class DirLock {
 public:
  DirLock() = default;
  // Locks `dir` (created if missing) or throws UserError naming the run that holds it.
  static DirLock acquire(const std::string& dir);
  ~DirLock();
  DirLock(DirLock&& o) noexcept : fd_(o.fd_), path_(std::move(o.path_)) { o.fd_ = -1; }
  DirLock& operator=(DirLock&& o) noexcept;
  DirLock(const DirLock&) = delete;
  DirLock& operator=(const DirLock&) = delete;
  bool held() const { return fd_ >= 0; }

 private:
  void release();
  int fd_ = -1;
  std::string path_;
};

}  // namespace mop
