// The step program against the streams' clocks (see step_walk.h).
#include "plan/step_walk.h"

#include <algorithm>
#include <cmath>

#include "core/error.h"

namespace mop {

double HostUpdateCosts::total() const {
  double n = 0;
  for (double e : elements) n += e;
  return n;
}

namespace {

// What one step leaves for the next, in seconds from the next step's start (≤ 0: done before it).
struct Carry {
  std::vector<double> weights_ready;  // per segment: its host-updated weights are back
  double state_end = -INFINITY;       // two passes: the state pass ends (it reads the gradients)
  double round_end = -INFINITY;       // the host round ends (the next round starts after it)
};

class Walk {
 public:
  Walk(const StepProgram& p, const WalkCosts& c, bool two_pass)
      : p_(p), c_(c), two_pass_(two_pass) {}

  // One step from `in`; returns its end on the compute stream and fills `out`.
  double step(const Carry& in, Carry& out) {
    r_ = WalkResult();
    t_ = 0, gathers_ = sums_ = copy_ = 0;
    const int S = p_.shape.segments;
    const size_t slots = size_t(p_.slots.shared_grads + 1);  // and the tied embedding's
    slot_free_.assign(slots, 0.0), slot_owner_.assign(slots, -1), slot_freed_order_.assign(slots, 0);
    group_slot_.assign(size_t(S + 1), -1), group_copy_end_.assign(size_t(S + 1), 0.0);
    stashed_.assign(size_t(S), 0.0), to_host_done_.assign(size_t(S), 0.0);
    for (const Action& a : p_.gradients) run(a, in);
    for (const Action& a : p_.apply) run(a, in);
    out = Carry();
    out.weights_ready.assign(size_t(S), -INFINITY);
    for (size_t s = 0; s < ready_.size(); ++s) out.weights_ready[s] = ready_[s] - t_;
    out.state_end = state_end_ - t_, out.round_end = round_end_ - t_;
    r_.step = t_;
    return t_;
  }
  const WalkResult& result() const { return r_; }

 private:
  static double at(const std::vector<double>& v, int i) {
    return i >= 0 && size_t(i) < v.size() ? v[size_t(i)] : 0.0;
  }
  void wait(double until, double& exposed) {
    if (until > t_) exposed += until - t_, t_ = until;
  }
  // A gradient slot for group g, of those the program declares (the tied embedding's group has its
  // own): the store's choice, of the free ones the one freed longest ago.
  void take_slot(int g) {
    const int shared = p_.slots.shared_grads;
    int slot = shared;  // the tied embedding's
    if (g != p_.shape.segments) {
      slot = -1;
      for (int i = 0; i < shared; ++i)
        if (slot_owner_[size_t(i)] < 0 &&
            (slot < 0 || slot_freed_order_[size_t(i)] < slot_freed_order_[size_t(slot)]))
          slot = i;
    }
    MOP_CHECK(slot >= 0, "the step program takes a gradient slot for group ", g, " with its ", shared,
              " in use");
    slot_owner_[size_t(slot)] = g, group_slot_[size_t(g)] = slot;
    wait(slot_free_[size_t(slot)], r_.slots);
  }
  void free_slot(int g, double when) {
    const int slot = group_slot_[size_t(g)];
    if (slot < 0) return;
    slot_owner_[size_t(slot)] = -1, group_slot_[size_t(g)] = -1;
    slot_free_[size_t(slot)] = when, slot_freed_order_[size_t(slot)] = ++releases_;
  }
  // The host round: the segments in forward order, each once its gradients are on the host.
  void host_round(const Carry& in) {
    const HostUpdateCosts& h = c_.host;
    wait(in.round_end, r_.host);  // one round at a time
    const double rate = two_pass_ ? h.rate_weights : h.rate_one;
    double clock = t_;
    ready_.assign(h.elements.size(), -INFINITY);
    for (size_t s = 0; s < h.elements.size(); ++s) {
      if (h.elements[s] <= 0) continue;
      clock = std::max(clock, at(to_host_done_, int(s))) + h.elements[s] / rate;
      ready_[s] = clock;
    }
    r_.two_pass = two_pass_;
    r_.host_update = h.total() / rate;
    r_.host_state = two_pass_ ? h.total() / h.rate_state : 0;
    state_end_ = two_pass_ ? clock + r_.host_state : -INFINITY;
    round_end_ = two_pass_ ? state_end_ : clock;
    if (!h.overlap) wait(round_end_, r_.host);
  }

  void run(const Action& a, const Carry& in) {
    const int s = a.begin;
    switch (a.kind) {
      case ActionKind::ZeroGrads:
        t_ += c_.zero_grads;
        break;
      case ActionKind::BeginForward:
      case ActionKind::BeginBackward:
      case ActionKind::Release:
        break;
      case ActionKind::WeightsReady:
        wait(at(in.weights_ready, s), r_.host);
        break;
      case ActionKind::WaitUpdate:
        break;  // the device update is priced in turn (below)
      case ActionKind::Forward:
        t_ += at(c_.forward, s);
        break;
      case ActionKind::Backward:
        t_ += at(c_.backward, s);
        break;
      case ActionKind::ReduceGrads:
        r_.sums_total += at(c_.reduce, s);
        if (a.stream == StreamKind::Compute) {
          t_ += at(c_.reduce, s), r_.comm_on_compute += at(c_.reduce, s);
        } else {
          sums_ = std::max(sums_, t_) + at(c_.reduce, s);
        }
        break;
      case ActionKind::JoinReduce:
        wait(sums_, r_.sums);
        break;
      case ActionKind::GradsToHost:
        // The previous round's state pass still reads the gradients' staging: the issuing thread
        // waits (HostPipeline::grads_final), and so does the compute stream behind it.
        if (two_pass_) wait(in.state_end, r_.host);
        copy_ = std::max(copy_, t_) + at(c_.to_host, s);
        to_host_done_[size_t(s)] = copy_;
        group_copy_end_[size_t(s)] = copy_;
        break;
      case ActionKind::StashGrads:
        copy_ = std::max(copy_, t_) + at(c_.stash, s);
        stashed_[size_t(s)] = group_copy_end_[size_t(s)] = copy_;
        break;
      case ActionKind::GradNorms:
        t_ += at(c_.norms, s);
        break;
      case ActionKind::ReleaseGrads: {
        // Freed once the segment's copies are done (group S, the tied embedding's, with segment 0).
        const int seg = s == p_.shape.segments ? 0 : s;
        free_slot(s, std::max(t_, group_copy_end_[size_t(seg)]));
        break;
      }
      case ActionKind::GradSlot:
        take_slot(s);
        // Streamed, a later micro-batch: the running sum comes back once its copy out is done.
        if (!p_.shape.sliced && a.micro_batch > 0) {
          const int seg = s == p_.shape.segments ? 0 : s;
          wait(stashed_[size_t(seg)], r_.slots);
          t_ += at(c_.fetch, s), r_.fetch += at(c_.fetch, s);
        }
        break;
      case ActionKind::ReduceScatter:
        t_ += at(c_.reduce_scatter, s), r_.comm_on_compute += at(c_.reduce_scatter, s);
        r_.sums_total += at(c_.reduce_scatter, s);
        free_slot(s, t_);
        break;
      case ActionKind::Gather:
        gathers_ = std::max(gathers_, t_) + at(c_.gather, s);
        r_.gather_total += at(c_.gather, s);
        break;
      case ActionKind::JoinGathers:
        wait(gathers_, r_.gathers);
        break;
      case ActionKind::ReadLosses:
        t_ += c_.read_losses;
        break;
      case ActionKind::Optimizer:
        t_ += c_.optimizer;
        break;
      // The overlapped device AdamW shares the device with the next forward it runs beside: its
      // kernels were measured 2–5% hidden next to the expert GEMMs (kernels/README.md), so it
      // costs the step its own time.
      case ActionKind::DeviceUpdate:
        t_ += at(c_.device_update, s);
        break;
      case ActionKind::HostUpdate:
        host_round(in);
        break;
      case ActionKind::Broadcast:
        t_ += c_.broadcast;
        break;
    }
  }

  const StepProgram& p_;
  const WalkCosts& c_;
  const bool two_pass_;
  WalkResult r_;
  double t_ = 0, gathers_ = 0, sums_ = 0, copy_ = 0;
  std::vector<double> slot_free_;
  std::vector<int> slot_owner_, group_slot_;
  std::vector<uint64_t> slot_freed_order_;
  uint64_t releases_ = 0;
  std::vector<double> group_copy_end_, stashed_, to_host_done_, ready_;
  double state_end_ = -INFINITY, round_end_ = -INFINITY;
};

// The steady step of one host mode: the step repeated from nothing pending until its time settles.
WalkResult steady(const StepProgram& p, const WalkCosts& c, bool two_pass) {
  Walk w(p, c, two_pass);
  Carry in, out;
  // Only the host update reaches into the next step; without one, one step is the steady one.
  const bool carries = std::any_of(p.apply.begin(), p.apply.end(),
                                   [](const Action& a) { return a.kind == ActionKind::HostUpdate; });
  if (!carries) {
    w.step(in, out);
    return w.result();
  }
  double last = -1;
  for (int i = 0; i < 8; ++i) {
    const double t = w.step(in, out);
    if (std::fabs(t - last) <= 1e-12 * std::max(1.0, t)) break;
    last = t, in = out;
  }
  return w.result();
}

}  // namespace

WalkResult walk_step(const StepProgram& program, const WalkCosts& costs) {
  const WalkResult one = steady(program, costs, false);
  if (!costs.host.overlap || costs.host.total() <= 0) return one;
  // The host pipeline takes whichever mode costs the step less (it probes the other now and then).
  const WalkResult two = steady(program, costs, true);
  return two.step < one.step ? two : one;
}

}  // namespace mop
