// TimedOps: an Ops decorator that measures where a step's time goes, by op category (attention,
// dense GEMMs, experts, router/permute, loss, optimizer, communication, other). On the GPU each
// op is bracketed by timing events on the backend's stream (read once per step, so timing does
// not serialise the stream); on the CPU by wall-clock time around the (synchronous) op.
#pragma once

#include <array>
#include <memory>
#include <string>
#include <vector>

#include "ops/ops.h"

namespace mop {

enum class OpCategory : uint8_t {
  Attention, DenseGemm, Experts, RouterPermute, Loss, Optimizer, Communication, Other
};
constexpr int kNumOpCategories = 8;
const char* op_category_name(OpCategory c);

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

class TimedOps final : public Ops {
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

  Device device() const override { return inner_->device(); }
  void synchronize() override { inner_->synchronize(); }
  Stream stream() const override { return inner_->stream(); }
  void prepare(const OpShapes& s) override { inner_->prepare(s); }
  size_t workspace_bytes() const override { return inner_->workspace_bytes(); }

  void fill(Tensor x, double v) override;
  void copy(Tensor dst, const Tensor& src) override;
  void add(Tensor out, const Tensor& a, const Tensor& b) override;
  void sumsq(Tensor out, const Tensor& x) override;
  void sum(Tensor out, const Tensor& x) override;
  void gemm(Tensor c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta) override;
  void grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& o) override;
  void grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w, const Tensor& o) override;
  void grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& o,
                               bool accumulate = true) override;
  void embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) override;
  void embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) override;
  void rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) override;
  void rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                   const Tensor& rstd, bool acc) override;
  void rope_fwd(Tensor x, const Tensor& pos, float theta) override;
  void rope_bwd(Tensor dx, const Tensor& pos, float theta) override;
  void attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                     int batch, float scale, bool causal) override;
  void attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                     const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                     int batch, float scale, bool causal) override;
  void attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                       int batch) override;
  void swiglu_fwd(Tensor h, const Tensor& gu) override;
  void swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) override;
  void router_fwd(Tensor idx, Tensor w, Tensor probs, Tensor lse, const Tensor& logits, bool renorm) override;
  void router_bwd(Tensor dlogits, const Tensor& dw, const Tensor& probs, const Tensor& lse,
                  const Tensor& idx, const Tensor& w, const Tensor& aux_grad, float z,
                  bool renorm) override;
  void moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                    const Tensor& counts, int k, float aux, float z) override;
  void moe_route_plan(Tensor counts, Tensor offsets, Tensor perm, Tensor slot, const Tensor& idx) override;
  void moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm) override;
  void moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot, int k, bool acc) override;
  void moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot, const Tensor& w, bool acc) override;
  void moe_unpermute_bwd(Tensor dyp, Tensor dw, const Tensor& dy, const Tensor& yp,
                         const Tensor& slot, const Tensor& w) override;
  void lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                     const Tensor& targets, Tensor ws) override;
  void lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const Tensor& targets,
                     const Tensor& lse, float scale, Tensor ws) override;
  void lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                         const Tensor& w, const Tensor& targets, float grad_scale,
                         Tensor workspace) override;
  void adamw_step(Tensor p, Tensor m, Tensor v, const Tensor& g, const AdamWArgs& a) override;
  void adamw_step_cast(Tensor p, Tensor m, Tensor v, const Tensor& g, const AdamWArgs& a,
                       Tensor w) override;

 private:
  struct Clock;  // CUDA events or host time
  void begin(OpCategory c, const char* call);
  void end();
  std::unique_ptr<Ops> inner_;
  std::unique_ptr<Clock> clock_;
  int forced_ = -1;
  StepPhase phase_ = StepPhase::Forward;
};

}  // namespace mop
