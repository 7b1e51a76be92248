// The runtime (see runtime.h): the CPU's synchronous implementation, and the CUDA runtime's when
// it is compiled in. This file and the backends in src/ops/ are the only places that call CUDA.
#include "runtime/runtime.h"

#include <sched.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "runtime/nccl_comm.h"

#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>

#include "runtime/cuda_check.h"
#endif

namespace mop {

#ifdef MOP_HAVE_CUDA
namespace {
cudaStream_t cuda_stream(Stream s) { return static_cast<cudaStream_t>(s.native()); }
}  // namespace
#endif

void Stream::synchronize() const {
  if (is_null()) return;
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaStreamSynchronize(cuda_stream(*this)));
#endif
}

void Stream::wait(const Event& event) const {
  if (is_null() || !event.native()) return;
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaStreamWaitEvent(cuda_stream(*this), static_cast<cudaEvent_t>(event.native()), 0));
#endif
}

OwnedStream::OwnedStream(Device device) {
  if (device == Device::CPU) return;
#ifdef MOP_HAVE_CUDA
  cudaStream_t s = nullptr;
  MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  stream_ = Stream::wrap(device, s);
#else
  MOP_CHECK(false, "a GPU stream in a binary built without CUDA (MOP_CUDA=OFF)");
#endif
}

OwnedStream::~OwnedStream() {
  if (stream_.is_null()) return;
#ifdef MOP_HAVE_CUDA
  cudaStreamSynchronize(cuda_stream(stream_));  // no throwing from a destructor
  cudaStreamDestroy(cuda_stream(stream_));
#endif
}

OwnedStream& OwnedStream::operator=(OwnedStream&& o) noexcept {
  if (this != &o) {
    this->~OwnedStream();
    stream_ = o.stream_;
    o.stream_ = Stream();
  }
  return *this;
}

Event::Event(Device device, bool timing) : device_(device) {
  if (device == Device::CPU) return;
#ifdef MOP_HAVE_CUDA
  cudaEvent_t e = nullptr;
  MOP_CUDA_CHECK(cudaEventCreateWithFlags(&e, timing ? cudaEventDefault : cudaEventDisableTiming));
  native_ = e;
#else
  MOP_CHECK(false, "a GPU event in a binary built without CUDA (MOP_CUDA=OFF)");
#endif
}

Event::~Event() {
#ifdef MOP_HAVE_CUDA
  if (native_) cudaEventDestroy(static_cast<cudaEvent_t>(native_));
#endif
}

Event& Event::operator=(Event&& o) noexcept {
  if (this != &o) {
    this->~Event();
    device_ = o.device_;
    native_ = o.native_;
    o.native_ = nullptr;
  }
  return *this;
}

void Event::record(Stream stream) {
  if (!native_) return;
  MOP_CHECK(!stream.is_null(), "a GPU event recorded on the host's null stream");
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(native_), cuda_stream(stream)));
#endif
}

void Event::synchronize() const {
  if (!native_) return;
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaEventSynchronize(static_cast<cudaEvent_t>(native_)));
#endif
}

float Event::elapsed_ms_since(const Event& start) const {
  MOP_CHECK(native_ && start.native_, "elapsed time between host events");
  float ms = 0;
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaEventElapsedTime(&ms, static_cast<cudaEvent_t>(start.native_),
                                      static_cast<cudaEvent_t>(native_)));
#endif
  return ms;
}

void copy_async(void* dst, const void* src, size_t bytes, Stream stream) {
  if (bytes == 0 || dst == src) return;
  if (stream.is_null()) {
    std::memcpy(dst, src, bytes);
    return;
  }
#ifdef MOP_HAVE_CUDA
  // Unified addressing: the runtime tells host from device pointers.
  MOP_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, cuda_stream(stream)));
#endif
}

void* allocate_memory(MemKind kind, size_t bytes) {
  if (bytes == 0) return nullptr;
  void* p = nullptr;
  switch (kind) {
    case MemKind::Host:
      p = std::aligned_alloc(kArenaAlign, align_up(bytes));
      MOP_CHECK(p, "host allocation of ", format_bytes(double(bytes)), " failed");
      std::memset(p, 0, bytes);
      return p;
#ifdef MOP_HAVE_CUDA
    case MemKind::Pinned: {
      cudaError_t e = cudaHostAlloc(&p, bytes, cudaHostAllocDefault);
      MOP_CHECK(e == cudaSuccess, "cudaHostAlloc(", format_bytes(double(bytes)), "): ",
                cudaGetErrorString(e));
      std::memset(p, 0, bytes);
      return p;
    }
    case MemKind::Device: {
      cudaError_t e = cudaMalloc(&p, bytes);
      MOP_CHECK(e == cudaSuccess, "cudaMalloc(", format_bytes(double(bytes)), "): ",
                cudaGetErrorString(e));
      e = cudaMemset(p, 0, bytes);
      MOP_CHECK(e == cudaSuccess, "cudaMemset: ", cudaGetErrorString(e));
      // The memset runs on the legacy default stream, which the backends' non-blocking streams do
      // not wait for: finish it here (allocation happens before the step loop).
      e = cudaDeviceSynchronize();
      MOP_CHECK(e == cudaSuccess, "cudaDeviceSynchronize: ", cudaGetErrorString(e));
      return p;
    }
#else
    case MemKind::Pinned:
    case MemKind::Device:
      MOP_CHECK(false, "this binary was built without CUDA (MOP_CUDA=OFF)");
#endif
  }
  return nullptr;
}

void release_memory(MemKind kind, void* ptr) {
  if (!ptr) return;
  switch (kind) {
    case MemKind::Host: std::free(ptr); break;
#ifdef MOP_HAVE_CUDA
    case MemKind::Pinned: cudaFreeHost(ptr); break;
    case MemKind::Device: cudaFree(ptr); break;
#else
    default: break;
#endif
  }
}

namespace {

// A number in a small kernel file (cgroup limits, /proc); 0 when absent, empty or "max".
size_t read_limit(const std::string& path) {
  FILE* f = std::fopen(path.c_str(), "r");
  if (!f) return 0;
  char buf[64] = {0};
  const size_t n = std::fread(buf, 1, sizeof buf - 1, f);
  std::fclose(f);
  buf[n] = 0;
  char* end = nullptr;
  const unsigned long long v = std::strtoull(buf, &end, 10);
  return end == buf ? 0 : size_t(v);
}

// A "Name:  N kB" line of /proc/self/status, in KiB (0: absent).
size_t read_proc_status_kib(const char* name) {
  FILE* f = std::fopen("/proc/self/status", "r");
  if (!f) return 0;
  char line[256];
  size_t kib = 0;
  const size_t len = std::strlen(name);
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, name, len) == 0) kib = size_t(std::strtoull(line + len, nullptr, 10));
  std::fclose(f);
  return kib;
}

// This process's cgroup memory limit (v2: memory.max of its cgroup; v1: the memory controller's
// limit_in_bytes), 0 for none.
size_t cgroup_memory_limit() {
  FILE* f = std::fopen("/proc/self/cgroup", "r");
  if (!f) return 0;
  char line[4096];
  std::string v2;
  while (std::fgets(line, sizeof line, f))
    if (std::strncmp(line, "0::", 3) == 0) {
      v2 = line + 3;
      while (!v2.empty() && (v2.back() == '\n' || v2.back() == '\r')) v2.pop_back();
    }
  std::fclose(f);
  if (!v2.empty()) {
    const size_t limit = read_limit("/sys/fs/cgroup" + v2 + "/memory.max");
    if (limit > 0) return limit;
  }
  const size_t v1 = read_limit("/sys/fs/cgroup/memory/memory.limit_in_bytes");
  return v1 >= (size_t(1) << 60) ? 0 : v1;  // v1 writes a huge number for "no limit"
}

}  // namespace

size_t host_memory_limit() {
  size_t limit = cgroup_memory_limit();
  struct rlimit rl {};
  if (getrlimit(RLIMIT_AS, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY) {
    // The address space already in use counts against it.
    const size_t used = read_proc_status_kib("VmSize:") * 1024;
    const size_t room = size_t(rl.rlim_cur) > used ? size_t(rl.rlim_cur) - used : 0;
    limit = limit == 0 ? room : std::min(limit, room);
  }
  return limit;
}

MemoryInfo memory_info(Device device) {
  MemoryInfo m;
  if (device == Device::CPU) {
    const long pages = sysconf(_SC_PHYS_PAGES), avail = sysconf(_SC_AVPHYS_PAGES);
    const long page = sysconf(_SC_PAGE_SIZE);
    if (pages > 0 && page > 0) m.total = size_t(pages) * size_t(page);
    if (avail > 0 && page > 0) m.free = size_t(avail) * size_t(page);
    if (const size_t limit = host_memory_limit(); limit > 0)
      m.total = std::min(m.total, limit), m.free = std::min(m.free, limit);
    return m;
  }
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaMemGetInfo(&m.free, &m.total));
#endif
  return m;
}

int host_cores() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof set, &set) == 0) return CPU_COUNT(&set);
  const long n = sysconf(_SC_NPROCESSORS_ONLN);
  return n > 0 ? int(n) : 1;
}

int this_node_cores(int ranks_on_node) {
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  const int mine = host_cores();
  if (online > 0 && mine >= online) return int(online);
  return std::max(1, mine * std::max(1, ranks_on_node));
}

size_t peak_resident_bytes() { return read_proc_status_kib("VmHWM:") * 1024; }

bool cuda_built() {
#ifdef MOP_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int gpu_count() {
#ifdef MOP_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
#else
  return 0;
#endif
}

void select_gpu(int index) {
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaSetDevice(index));
#else
  MOP_CHECK(false, "select_gpu(", index, ") in a binary built without CUDA (MOP_CUDA=OFF)");
#endif
}

std::string gpu_name() {
#ifdef MOP_HAVE_CUDA
  cudaDeviceProp prop{};
  if (gpu_count() > 0 && cudaGetDeviceProperties(&prop, current_gpu()) == cudaSuccess) return prop.name;
#endif
  return "";
}

int current_gpu() {
  int d = 0;
#ifdef MOP_HAVE_CUDA
  MOP_CUDA_CHECK(cudaGetDevice(&d));
#endif
  return d;
}

#ifndef MOP_HAVE_CUDA
std::unique_ptr<Comm> make_nccl_comm(Comm&, Stream, Stream) {
  MOP_CHECK(false, "NCCL collectives in a binary built without CUDA (MOP_CUDA=OFF)");
  return nullptr;
}

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, Stream stream, Stream follow) {
  return make_nccl_comm(*host, stream, follow);
}
#endif

}  // namespace mop
