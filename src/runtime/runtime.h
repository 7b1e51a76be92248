// The device-neutral runtime: streams, events, asynchronous copies, device and pinned memory,
// device memory info and device selection. Code outside src/ops/, kernels/ and this folder orders
// work across streams through it and never names CUDA.
//
// On the CPU (Device::CPU) everything is synchronous: the stream is the null stream, work issued
// on it has finished when the call returns, events are complete as soon as they are recorded and
// copies are memcpy. So the same code (the host optimizer's pipeline, the timing wrapper, the
// asynchronous comms) runs on both devices, and CPU tests exercise its ordering logic.
#pragma once

#include <cstddef>
#include <memory>
#include <string>

#include "core/tensor.h"
#include "runtime/memory.h"

namespace mop {

class Event;

// A handle to a stream of device work, not owning. The default handle is the null stream: the
// host, where work is done at once.
class Stream {
 public:
  Stream() = default;
  // The runtime's and the backends' own wrapper of a native stream (cudaStream_t).
  static Stream wrap(Device device, void* native) { return Stream(device, native); }
  Device device() const { return device_; }
  void* native() const { return native_; }
  bool is_null() const { return native_ == nullptr; }
  bool operator==(const Stream& o) const { return native_ == o.native_ && device_ == o.device_; }

  void synchronize() const;            // the host waits for the work issued so far
  void wait(const Event& event) const;  // work issued later waits for `event`

 private:
  Stream(Device device, void* native) : device_(device), native_(native) {}
  Device device_ = Device::CPU;
  void* native_ = nullptr;
};

// A stream of its own on the current device (a side stream), destroyed with the object after the
// work queued on it has finished. On the CPU it is the null stream.
class OwnedStream {
 public:
  OwnedStream() = default;
  explicit OwnedStream(Device device);
  ~OwnedStream();
  OwnedStream(OwnedStream&& o) noexcept : stream_(o.stream_) { o.stream_ = Stream(); }
  OwnedStream& operator=(OwnedStream&& o) noexcept;
  OwnedStream(const OwnedStream&) = delete;
  OwnedStream& operator=(const OwnedStream&) = delete;
  Stream get() const { return stream_; }

 private:
  Stream stream_;
};

// A point in a stream's work: recorded on a stream, waited for by the host or by other streams.
// With `timing`, two recorded events give the time between them (the timing wrapper).
class Event {
 public:
  Event() = default;
  explicit Event(Device device, bool timing = false);
  ~Event();
  Event(Event&& o) noexcept : device_(o.device_), native_(o.native_) { o.native_ = nullptr; }
  Event& operator=(Event&& o) noexcept;
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(Stream stream);
  void synchronize() const;  // the host waits until the work before the record is done
  // Milliseconds from `start` to this event; both recorded with timing and both complete.
  float elapsed_ms_since(const Event& start) const;
  void* native() const { return native_; }

 private:
  Device device_ = Device::CPU;
  void* native_ = nullptr;  // null on the CPU, where every event is complete
};

// Copies `bytes` between host memory (pinned or not) and device memory, or within one of them,
// in order on `stream` (the null stream: at once). Asynchronous copies from or to host memory
// need pinned host memory to overlap with compute.
void copy_async(void* dst, const void* src, size_t bytes, Stream stream);

// Memory of a kind (runtime/memory.h): host (aligned, pageable), pinned host, device. Pinned and
// device memory need a CUDA build; the allocation is zero-filled.
void* allocate_memory(MemKind kind, size_t bytes);
void release_memory(MemKind kind, void* ptr);

// Bytes free and in all on `device`'s memory (the current GPU), or for Device::CPU of the host's
// physical memory, capped by host_memory_limit().
struct MemoryInfo {
  size_t free = 0, total = 0;
};
MemoryInfo memory_info(Device device);
// What this process may still allocate by its own limits: the least of its cgroup's memory limit
// (v2 memory.max, v1 limit_in_bytes) and its address-space limit (ulimit -v) less the address
// space in use; 0 when neither limits it.
size_t host_memory_limit();
// Cores this process may run on (its affinity mask).
int host_cores();
// The cores of this node that `ranks_on_node` ranks like this process share: the node's online
// cores, or — when this process is bound to fewer (mpirun --bind-to) — its own times the ranks.
int this_node_cores(int ranks_on_node);
// The most host memory this process has had resident (VmHWM; pinned buffers included), 0 where
// the system does not tell.
size_t peak_resident_bytes();

// Devices: whether this binary has the CUDA backend, how many GPUs it sees, and the GPU of the
// calling thread (one per local rank; threads that issue device work select it first).
bool cuda_built();
int gpu_count();
void select_gpu(int index);
int current_gpu();
std::string gpu_name();  // the current GPU's product name ("" without one)

}  // namespace mop
