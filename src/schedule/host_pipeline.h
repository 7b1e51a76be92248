// HostPipeline: the part of the step's schedule that updates the parameters whose fp32 master
// weights and Adam m, v live in host memory (the optimizer's host_params()). Per parameter, in the order the next forward needs them (embedding, layer 0, …, head):
//   gradient (fp32, on the GPU) → bf16 on the GPU → host (copy stream, started as soon as the
//   last micro-batch's backward has finished that layer) → host AdamW on worker threads (once the
//   step's clip scale and non-finite check are known) → bf16 weights → GPU (upload stream).
// The next forward of layer i waits only for layer i's weights (one event per parameter). On CPU
// runs the same pipeline runs on host memory (no copies), which tests its synchronisation.
// Overlapped, the update can run in two passes over the host state: the weights pass reads master,
// m, v and the gradient and writes only the new weights (16 of the update's 28 bytes per
// parameter, the part the next forward waits for); the state pass then repeats the same
// arithmetic and writes master, m and v while the next step computes. The next step's gradient
// copy of a parameter waits for its state pass (the gradient staging is reused), so two passes pay
// only when the next step computes long enough to hide the state pass (several micro-batches):
// each round measures what its mode cost the step and the next round takes the cheaper mode
// (choose_two_pass), trying the other one now and then.
// The update is the plain step's update: nothing is delayed or approximated; overlapped or not,
// the weights and the state are the same bit for bit.
#pragma once

#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "core/tensor.h"
#include "core/thread_pool.h"
#include "ops/ops.h"
#include "ops/timed_ops.h"
#include "optim/optimizer.h"

namespace mop {

struct OffloadStats {
  double bytes_to_host = 0, bytes_to_device = 0;
  double update_seconds = 0;  // host update until the new weights exist (wall, all params)
  double state_seconds = 0;   // the state pass after it (overlapped updates only)
  double wait_seconds = 0;    // time the step waited for host updates (exposed)
};

// The pipeline both backends share: a dispatcher thread updates the parameters in order (one
// round per step), the main thread gates each segment's use on its parameters' round. Backends
// fill in how a gradient reaches the host and how the new weights get back (the hooks below).
class HostPipeline {
 public:
  virtual ~HostPipeline();
  HostPipeline(const HostPipeline&) = delete;
  HostPipeline& operator=(const HostPipeline&) = delete;

  // The gradients of `segment` are final (called from the last micro-batch's backward): start
  // moving them to the host. Streamed gradients (HostParam::grad without data) come from `grad`
  // (by parameter index), where they are now.
  using GradSource = std::function<Tensor(int param)>;
  void grads_final(int segment, const GradSource& grad = {});
  // Update every host parameter with args[i] (for params()[i]); starts at once, and returns when
  // done unless `overlap` (then weights_ready() gates their use).
  void update(const std::vector<AdamWArgs>& args, bool overlap);
  // After the optimizer's step: update() with its host arguments, or discard_grads() when the
  // step was skipped.
  void finish_step(const StepReport& report, bool overlap) {
    if (report.applied)
      update(report.host_args, overlap);
    else
      discard_grads();
  }
  // The step's gradients will not be used (a skipped step): the next step's grads_final() moves
  // its own, also for the segments this step already moved.
  void discard_grads();
  // Before the forward reads the weights of `segment`: wait for them (on the GPU: make the compute
  // stream wait).
  void weights_ready(int segment);
  // Waits for all outstanding host work (checkpoints, shutdown).
  void drain();
  OffloadStats take_stats();
  // The mode of round `round` (1, 2, …) from the last measured cost of each (seconds the step
  // waited, < 0: not measured yet): round 1 two passes, round 2 one pass, then the cheaper, and
  // every kProbeEvery-th round the other one, to notice when the balance changes.
  static constexpr uint64_t kProbeEvery = 32;
  static bool choose_two_pass(uint64_t round, double one_pass_cost, double two_pass_cost);
  const std::vector<HostParam>& params() const { return params_; }
  // The staging this pipeline allocated: on the ops device (next to a GPU) and in host memory.
  virtual size_t device_staging_bytes() const { return 0; }
  virtual size_t host_staging_bytes() const { return 0; }
  // While tracing, host updates and the waits for them are recorded (steady-clock seconds);
  // take_trace returns them relative to t0.
  void set_tracing(bool on);
  std::vector<TraceEvent> take_trace(double t0);

 protected:
  HostPipeline(std::vector<HostParam> params, int threads);
  // The dispatcher thread: start() at the end of the backend's constructor, stop() first in its
  // destructor (the hooks use the backend's members).
  void start();
  void stop();

  // Main thread. copy_grad: params()[i]'s gradient (`grad`) is final, start moving it to the
  // host (returns the bytes moved). weights_used: params()[i]'s update of this round is done and the
  // caller is about to use its weights. drained: every update of the round is done.
  virtual double copy_grad(size_t i, const Tensor& grad) = 0;
  // Around the copies of one segment's gradients.
  virtual void begin_copies(int segment) {}
  virtual void end_copies(int segment) {}
  virtual void weights_used(size_t i) {}
  virtual void drained() {}
  // Dispatcher thread, per parameter in order: before_update waits for its gradient (untimed),
  // update_param runs AdamW's `pass` (timed as the update): Both and Weights write the compute
  // weights or their staging, after_update sends them on (returns the bytes moved); State, once
  // every parameter's Weights pass is done, writes master, m and v. dispatcher_started: once, on
  // the thread.
  enum class Pass { Both, Weights, State };
  virtual void dispatcher_started() {}
  virtual void before_update(size_t i) {}
  virtual void update_param(size_t i, const AdamWArgs& args, Pass pass) = 0;
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
  bool two_pass_ = false;
  // Cost of the last round of each mode [one pass, two passes]: its update until the weights
  // existed, plus (two passes) the next step's waits for its state pass. round_seconds_ is set by
  // the dispatcher, gate_seconds_ summed by grads_final; both read at the next update().
  double cost_[2] = {-1, -1};
  double round_seconds_ = 0, gate_seconds_ = 0;
  std::vector<uint64_t> done_gen_;   // the last round whose weights are written, per parameter
  std::vector<uint64_t> state_gen_;  // the last round whose state is written, per parameter
  uint64_t gen_ = 0;
  bool busy_ = false, stop_ = false;
  OffloadStats stats_;
  std::thread dispatcher_;
  std::mutex trace_mu_;
  bool tracing_ = false;
  std::vector<TraceEvent> trace_;
};

// CPU backend: host-side pipeline with a dispatcher thread and the host AdamW engine.
std::unique_ptr<HostPipeline> make_cpu_host_pipeline(std::vector<HostParam> params, int threads);
// Device backends (host_pipeline_staged.cpp): streams, events, pinned staging.
std::unique_ptr<HostPipeline> make_staged_host_pipeline(Ops& ops, std::vector<HostParam> params,
                                                        int threads);
// The pipeline for `ops`' device (null when there are no host-placed parameters).
std::unique_ptr<HostPipeline> make_host_pipeline(Ops& ops, std::vector<HostParam> params, int threads);

}  // namespace mop
