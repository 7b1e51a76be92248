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

#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
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

// The pipeline both backends share: a dispatcher thread updates the parameters in order (one
// round per step), the main thread gates each stage's use on its parameters' round. Backends fill
// in how a gradient reaches the host and how the new weights get back (the hooks below).
class HostOffload {
 public:
  virtual ~HostOffload();
  HostOffload(const HostOffload&) = delete;
  HostOffload& operator=(const HostOffload&) = delete;

  // The gradients of `stage` are final (called from the last micro-batch's backward): start
  // moving them to the host.
  void grads_final(int stage);
  // Update every host parameter with args[i] (for params()[i]); starts at once, and returns when
  // done unless `overlap` (then weights_ready() gates their use).
  void update(const std::vector<AdamWArgs>& args, bool overlap);
  // The step's gradients will not be used (a skipped step): the next step's grads_final() moves
  // its own, also for the stages this step already moved.
  void discard_grads();
  // Before the forward reads the weights of `stage`: wait for them (on the GPU: make the compute
  // stream wait).
  void weights_ready(int stage);
  // Waits for all outstanding host work (checkpoints, shutdown).
  void drain();
  OffloadStats take_stats();
  const std::vector<HostParam>& params() const { return params_; }
  // While tracing, host updates and the waits for them are recorded (steady-clock seconds);
  // take_trace returns them relative to t0.
  void set_tracing(bool on);
  std::vector<TraceEvent> take_trace(double t0);

 protected:
  HostOffload(std::vector<HostParam> params, int threads);
  // The dispatcher thread: start() at the end of the backend's constructor, stop() first in its
  // destructor (the hooks use the backend's members).
  void start();
  void stop();

  // Main thread. copy_grad: params()[i]'s gradient is final, start moving it to the host
  // (returns the bytes moved). weights_used: params()[i]'s update of this round is done and the
  // caller is about to use its weights. drained: every update of the round is done.
  virtual double copy_grad(size_t i) = 0;
  virtual void weights_used(size_t i) {}
  virtual void drained() {}
  // Dispatcher thread, per parameter in order: before_update waits for its gradient (untimed),
  // update_param runs AdamW and writes the compute weights or their staging (timed as the
  // update), after_update sends them on (returns the bytes moved). dispatcher_started: once, on
  // the thread.
  virtual void dispatcher_started() {}
  virtual void before_update(size_t i) {}
  virtual void update_param(size_t i, const AdamWArgs& args) = 0;
  virtual double after_update(size_t i) { return 0; }

  std::vector<HostParam> params_;
  ThreadPool pool_;

 private:
  void run();
  void trace(const std::string& name, const char* track, double start, double end);

  std::vector<bool> copied_;  // main thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<AdamWArgs> args_;
  std::vector<uint64_t> done_gen_;
  uint64_t gen_ = 0;
  bool busy_ = false, stop_ = false;
  OffloadStats stats_;
  std::thread dispatcher_;
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
