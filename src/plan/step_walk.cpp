// The step program against the streams' clocks (see step_walk.h).
#include "plan/step_walk.h"

#include <algorithm>
#include <cmath>
#include <map>

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
    std::map<PipeMessage, double> none;
    begin(in);
    while (advance(none) == State::AtLosses) pass_losses(t_);
    MOP_CHECK(state_ == State::Done, "a step program receives a message nobody sends");
    return end(out);
  }
  enum class State { Running, Waiting, AtLosses, Done };
  // A step in parts (a pipeline's ranks in turn): begin, advance until done — it stops at a receive
  // whose message is not in `sent` yet (Waiting) and at read-losses (AtLosses, until
  // pass_losses(when all ranks read them)) — and end.
  void begin(const Carry& in) {
    in_ = in;
    r_ = WalkResult();
    t_ = 0, gathers_ = sums_ = copy_ = pipe_ = 0;
    next_ = 0, state_ = State::Running;
    const int S = p_.shape.segments;
    const size_t slots = size_t(p_.slots.shared_grads + 1);  // and the tied embedding's
    slot_free_.assign(slots, 0.0), slot_owner_.assign(slots, -1), slot_freed_order_.assign(slots, 0);
    group_slot_.assign(size_t(S + 1), -1), group_copy_end_.assign(size_t(S + 1), 0.0);
    stashed_.assign(size_t(S), 0.0), to_host_done_.assign(size_t(S), 0.0);
  }
  State advance(std::map<PipeMessage, double>& sent) {
    const size_t n = p_.gradients.size() + p_.apply.size();
    while (next_ < n && state_ == State::Running) {
      const Action& a = next_ < p_.gradients.size() ? p_.gradients[next_] : p_.apply[next_ - p_.gradients.size()];
      if (a.kind == ActionKind::RecvActivation || a.kind == ActionKind::RecvGrad) {
        const auto it = sent.find(pipe_message(a));
        if (it == sent.end()) return State::Waiting;
        wait(it->second, r_.pipeline);
      } else if (a.kind == ActionKind::SendActivation || a.kind == ActionKind::SendGrad) {
        pipe_ = std::max(pipe_, t_) + c_.message;
        r_.messages_total += c_.message;
        MOP_CHECK(sent.emplace(pipe_message(a), pipe_).second, "a pipeline message sent twice: ", describe(a));
      } else if (a.kind == ActionKind::ReadLosses && !losses_passed_) {
        state_ = State::AtLosses;
        return state_;
      } else {
        run(a, in_);
      }
      losses_passed_ = false;
      ++next_;
    }
    if (next_ == n) state_ = State::Done;
    return state_;
  }
  double clock() const { return t_; }
  // Every rank has reached read-losses; the last at `when`.
  void pass_losses(double when) {
    wait(when, r_.losses_wait);
    losses_passed_ = true, state_ = State::Running;
  }
  double end(Carry& out) {
    const int S = p_.shape.segments;
    out = Carry();
    out.weights_ready.assign(size_t(S), -INFINITY);
    for (size_t s = 0; s < ready_.size(); ++s) out.weights_ready[s] = ready_[s] - t_;
    out.state_end = state_end_ - t_, out.round_end = round_end_ - t_;
    r_.step = t_;
    return t_;
  }
  const WalkResult& result() const { return r_; }
  State state() const { return state_; }

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
      case ActionKind::RecvActivation:
      case ActionKind::SendActivation:
      case ActionKind::RecvGrad:
      case ActionKind::SendGrad:
        MOP_CHECK(false, "the walk runs the pipeline's messages in advance()");
        break;
    }
  }

  const StepProgram& p_;
  const WalkCosts& c_;
  const bool two_pass_;
  WalkResult r_;
  double t_ = 0, gathers_ = 0, sums_ = 0, copy_ = 0, pipe_ = 0;
  Carry in_;
  size_t next_ = 0;  // the next action: the gradients', then the apply part's
  State state_ = State::Done;
  bool losses_passed_ = false;
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

// The pipeline's ranks in one host mode, each step together, repeated until steady.
std::vector<WalkResult> steady_pipeline(const std::vector<StepProgram>& programs,
                                        const std::vector<WalkCosts>& costs, bool two_pass) {
  const size_t n = programs.size();
  std::vector<Walk> walks;
  walks.reserve(n);
  for (size_t r = 0; r < n; ++r) walks.emplace_back(programs[r], costs[r], two_pass);
  std::vector<Carry> in(n), out(n);
  bool carries = false;
  for (const StepProgram& p : programs)
    for (const Action& a : p.apply) carries = carries || a.kind == ActionKind::HostUpdate;
  double last = -1;
  for (int i = 0; i < (carries ? 8 : 1); ++i) {
    std::map<PipeMessage, double> sent;
    for (size_t r = 0; r < n; ++r) walks[r].begin(in[r]);
    for (;;) {
      bool moved = false, running = false;
      for (Walk& w : walks) {
        const size_t before = sent.size();
        const Walk::State s = w.advance(sent);
        moved = moved || sent.size() > before;
        running = running || s == Walk::State::Waiting;
      }
      if (running && moved) continue;
      bool at_losses = true;
      double when = 0;
      for (const Walk& w : walks) {
        at_losses = at_losses && w.state() == Walk::State::AtLosses;
        when = std::max(when, w.clock());
      }
      if (at_losses) {
        for (Walk& w : walks) w.pass_losses(when);
        continue;
      }
      bool done = true;
      for (const Walk& w : walks) done = done && w.state() == Walk::State::Done;
      MOP_CHECK(done, "the pipeline's step programs wait for each other forever");
      break;
    }
    double t = 0;
    for (size_t r = 0; r < n; ++r) t = std::max(t, walks[r].end(out[r]));
    if (std::fabs(t - last) <= 1e-12 * std::max(1.0, t)) break;
    last = t, in = out;
  }
  std::vector<WalkResult> results;
  for (const Walk& w : walks) results.push_back(w.result());
  return results;
}

double slowest(const std::vector<WalkResult>& r) {
  double t = 0;
  for (const WalkResult& w : r) t = std::max(t, w.step);
  return t;
}

}  // namespace

PipeMessage pipe_message(const Action& a) {
  switch (a.kind) {
    case ActionKind::SendActivation: return {false, a.micro_batch, a.end};
    case ActionKind::RecvActivation: return {false, a.micro_batch, a.begin};
    case ActionKind::SendGrad: return {true, a.micro_batch, a.begin};
    case ActionKind::RecvGrad: return {true, a.micro_batch, a.end};
    default: MOP_CHECK(false, "not a pipeline message: ", action_name(a.kind));
  }
  return {};
}

std::vector<WalkResult> walk_pipeline(const std::vector<StepProgram>& programs,
                                      const std::vector<WalkCosts>& costs) {
  MOP_CHECK(programs.size() == costs.size() && !programs.empty(), "a pipeline walk of ", programs.size(),
            " programs and ", costs.size(), " costs");
  const std::vector<WalkResult> one = steady_pipeline(programs, costs, false);
  bool host = false;
  for (const WalkCosts& c : costs) host = host || (c.host.overlap && c.host.total() > 0);
  if (!host) return one;
  const std::vector<WalkResult> two = steady_pipeline(programs, costs, true);
  return slowest(two) < slowest(one) ? two : one;
}

WalkResult walk_step(const StepProgram& program, const WalkCosts& costs) {
  const WalkResult one = steady(program, costs, false);
  if (!costs.host.overlap || costs.host.total() <= 0) return one;
  // The host pipeline takes whichever mode costs the step less (it probes the other now and then).
  const WalkResult two = steady(program, costs, true);
  return two.step < one.step ? two : one;
}

}  // namespace mop
