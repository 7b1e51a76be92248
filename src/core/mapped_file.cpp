// MappedFile: open + fstat + mmap(PROT_READ) + madvise, and the matching munmap.
#include "core/mapped_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <utility>

#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {
int madvise_flag(MapAdvice advice) {
  switch (advice) {
    case MapAdvice::Normal:
      return MADV_NORMAL;
    case MapAdvice::Sequential:
      return MADV_SEQUENTIAL;
    case MapAdvice::Random:
      return MADV_RANDOM;
    case MapAdvice::WillNeed:
      return MADV_WILLNEED;
  }
  return MADV_NORMAL;
}
}  // namespace

MappedFile::MappedFile(std::string path, MapAdvice advice) : path_(std::move(path)) {
  // stat first: open(2) of a FIFO would wait for a writer. O_NONBLOCK covers a path swapped for a
  // FIFO after the stat (the fstat below refuses it); it changes nothing for a regular file.
  (void)regular_file_size(path_, "");
  int fd = ::open(path_.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  MOP_USER_CHECK(fd >= 0, path_, ": cannot open: ", std::strerror(errno));
  struct stat st {};
  if (::fstat(fd, &st) != 0) {
    int err = errno;
    ::close(fd);
    throw_user_error(path_, ": cannot stat: ", std::strerror(err));
  }
  if (!S_ISREG(st.st_mode)) {
    ::close(fd);
    throw_user_error(path_, ": is not a regular file");
  }
  size_ = size_t(st.st_size);
  if (size_ > 0) {
    void* p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
    int err = errno;
    ::close(fd);  // the mapping keeps the file referenced
    MOP_CHECK(p != MAP_FAILED, "mmap of ", path_, " (", size_, " bytes): ", std::strerror(err));
    data_ = static_cast<const uint8_t*>(p);
    advise(advice);
  } else {
    ::close(fd);
  }
}

MappedFile::~MappedFile() {
  release();
}

MappedFile::MappedFile(MappedFile&& other) noexcept
    : path_(std::move(other.path_)),
      data_(std::exchange(other.data_, nullptr)),
      size_(std::exchange(other.size_, 0)) {}

MappedFile& MappedFile::operator=(MappedFile&& other) noexcept {
  if (this != &other) {
    release();
    path_ = std::move(other.path_);
    data_ = std::exchange(other.data_, nullptr);
    size_ = std::exchange(other.size_, 0);
  }
  return *this;
}

void MappedFile::advise(MapAdvice advice) const {
  // Failure only loses the hint, so the result is ignored.
  if (data_) (void)::madvise(const_cast<uint8_t*>(data_), size_, madvise_flag(advice));
}

void MappedFile::release() {
  if (data_) ::munmap(const_cast<uint8_t*>(data_), size_);
  data_ = nullptr;
  size_ = 0;
}

}  // namespace mop
