// HostOffload: the optimizer for parameters whose fp32 master weights and Adam m, v live in host
// memory. Per parameter, in the order the next forward needs them (embedding, layer 0, …, head):
//   gradient (fp32, on the GPU) → bf16 on the GPU → host (copy stream, started as soon as the
//   last micro-batch's backward has finished that layer) → host AdamW on worker threads (once the
//   step's clip scale and non-finite check are known) → bf16 weights → GPU (upload stream).
// The next forward of layer i waits only for layer i's weights (one event per parameter). On CPU
// runs the same pipeline runs on host memory (no copies), which tests its synchronisation.
// The update is the plain step's update: nothing is delayed or approximated; overlapped or not,
// the weights are the same bit for bit.
#pragma once

#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "core/tensor.h"
#include "ops/ops.h"
#include "ops/timed_ops.h"

namespace mop {

struct HostParam {
  int param = 0;
  int stage = 0;           // 0 embedding, 1..L layers, L+1 final norm and LM head
  Tensor master, m, v;     // fp32, host memory
  Tensor grad;             // accumulated gradient on the ops device (fp32)
  Tensor weights;          // compute weights on the ops device
};

struct OffloadStats {
  double bytes_to_host = 0, bytes_to_device = 0;
  double update_seconds = 0;  // host worker time spent updating (wall, all params)
  double wait_seconds = 0;    // time the step waited for host updates (exposed)
};

class HostOffload {
 public:
  virtual ~HostOffload() = default;
  // The gradients of `stage` are final (called from the last micro-batch's backward): start
  // moving them to the host.
  virtual void grads_final(int stage) = 0;
  // Update every host parameter with args[i] (for params()[i]); starts at once, and returns when
  // done unless `overlap` (then weights_ready() gates their use).
  virtual void update(const std::vector<AdamWArgs>& args, bool overlap) = 0;
  // Before the forward reads the weights of `stage`: make the compute stream wait for them.
  virtual void weights_ready(int stage) = 0;
  // Waits for all outstanding host work (checkpoints, shutdown).
  virtual void drain() = 0;
  virtual OffloadStats take_stats() = 0;
  virtual const std::vector<HostParam>& params() const = 0;
  // While tracing, host updates and the waits for them are recorded (steady-clock seconds);
  // take_trace returns them relative to t0.
  void set_tracing(bool on);
  std::vector<TraceEvent> take_trace(double t0);

 protected:
  void trace(const std::string& name, const char* track, double start, double end);

 private:
  std::mutex trace_mu_;
  bool tracing_ = false;
  std::vector<TraceEvent> trace_;
};

// CPU backend: host-side pipeline with a dispatcher thread and the host AdamW engine.
std::unique_ptr<HostOffload> make_cpu_host_offload(Ops& ops, std::vector<HostParam> params,
                                                   int threads);
// CUDA backend (cuda_host_offload.cpp): streams, events, pinned staging.
std::unique_ptr<HostOffload> make_cuda_host_offload(Ops& ops, std::vector<HostParam> params,
                                                    int threads);

}  // namespace mop
