// TimedOps: an Ops front that measures where a step's time goes, by op category (attention,
// dense GEMMs, experts, router/permute, loss, optimizer, communication, other; op_list.inc gives
// each op's). On the GPU each
// op is bracketed by timing events on the backend's stream (read once per step, so timing does
// not serialise the stream); on the CPU by wall-clock time around the (synchronous) op.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace mop {

enum class StepPhase : uint8_t { Forward, Backward, Optimizer };
constexpr int kNumStepPhases = 3;

// One interval of a Chrome trace (seconds from the trace's start).
struct TraceEvent {
  std::string name, category, track;
  double start = 0, duration = 0;
};
// Writes events as a Chrome trace (chrome://tracing, Perfetto): one row per track.
void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events);

struct OpTimes {
  std::array<double, kNumOpCategories> seconds{};
  std::array<double, kNumStepPhases> phase_seconds{};  // the same time split by phase
  double total() const;
  std::string describe() const;  // "attention 120 ms (31%) | experts ..."
};

// An Ops front on the same backend as `inner` that times every op it issues (as their observer);
// ops issued through inner() are not timed.
class TimedOps final : public Ops, private OpObserver {
 public:
  explicit TimedOps(std::unique_ptr<Ops> inner);
  ~TimedOps() override;
  Ops& inner() { return *inner_; }
  // Sums of the ops issued since the last call, by category (waits for them to finish).
  OpTimes collect();
  // Brackets a collective (TimedComm): issued on the backend's stream, where it holds up the
  // compute that follows, or blocking on the CPU; either way its time is exposed communication.
  // `call` must outlive the step (a string literal).
  void begin_comm(const char* call) { begin(OpCategory::Communication, call); }
  void end_comm() { end(); }
  // While set, every op counts under `c` (e.g. the optimizer step's copies and norms);
  // communication stays communication.
  void force_category(OpCategory c) { forced_ = int(c); }
  void clear_forced_category() { forced_ = -1; }
  // The phase the following ops belong to.
  void set_phase(StepPhase phase) { phase_ = phase; }
  // Records every op from now on; stop_trace() returns them (times relative to the start, on the
  // host clock's scale: GPU ops are placed by their event times from a start event).
  void start_trace();
  std::vector<TraceEvent> stop_trace();
  double trace_host_start() const;  // steady-clock seconds at start_trace()

 private:
  struct Clock;  // CUDA events or host time
  void op_begin(OpId id) override { begin(op_info(id).category, op_info(id).name); }
  void op_end() override { end(); }
  void begin(OpCategory c, const char* call);
  void end();
  std::unique_ptr<Ops> inner_;
  std::unique_ptr<Clock> clock_;
  int forced_ = -1;
  StepPhase phase_ = StepPhase::Forward;
};

}  // namespace mop
