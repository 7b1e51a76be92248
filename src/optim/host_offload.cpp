// HostOffload's shared pipeline (dispatcher thread, rounds, waits, stats, trace) and the CPU
// backend: gradients are copied aside when final (so the next step may zero them) and the
// dispatcher writes each parameter's compute weights itself.
#include "optim/host_offload.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include "core/memory.h"
#include "optim/host_adamw.h"

namespace mop {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

HostOffload::HostOffload(std::vector<HostParam> params, int threads)
    : params_(std::move(params)), pool_(threads), copied_(params_.size(), false),
      done_gen_(params_.size(), 0) {}

HostOffload::~HostOffload() {
  if (dispatcher_.joinable()) {  // a backend that did not stop() its dispatcher: a bug
    std::fprintf(stderr, "internal error: HostOffload destroyed with its dispatcher running\n");
    std::abort();
  }
}

void HostOffload::start() { dispatcher_ = std::thread([this] { run(); }); }

void HostOffload::stop() {
  if (!dispatcher_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  dispatcher_.join();
}

void HostOffload::grads_final(int stage) {
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].stage == stage && !copied_[i]) {
      const double bytes = copy_grad(i);
      copied_[i] = true;
      std::lock_guard<std::mutex> lock(mu_);
      stats_.bytes_to_host += bytes;
    }
}

void HostOffload::update(const std::vector<AdamWArgs>& args, bool overlap) {
  MOP_CHECK(args.size() == params_.size(), "host update arguments");
  drain();  // one round at a time
  for (const HostParam& p : params_) grads_final(p.stage);  // those not final yet
  {
    std::lock_guard<std::mutex> lock(mu_);
    args_ = args;
    ++gen_;
    busy_ = true;
  }
  std::fill(copied_.begin(), copied_.end(), false);
  cv_.notify_all();
  if (!overlap) drain();
}

void HostOffload::discard_grads() { std::fill(copied_.begin(), copied_.end(), false); }

void HostOffload::weights_ready(int stage) {
  const double t0 = now();
  std::vector<size_t> updated;  // the stage's parameters updated at least once
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].stage == stage && done_gen_[i] < gen_) return false;
      return true;
    });
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].stage == stage && done_gen_[i] > 0) updated.push_back(i);
  }
  for (size_t i : updated) weights_used(i);
  const double t1 = now();
  if (t1 - t0 > 1e-5) trace("wait stage " + std::to_string(stage), "main thread (waits)", t0, t1);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.wait_seconds += t1 - t0;
}

void HostOffload::drain() {
  const double t0 = now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  drained();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.wait_seconds += now() - t0;
}

OffloadStats HostOffload::take_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  OffloadStats s = stats_;
  stats_ = OffloadStats{};
  return s;
}

void HostOffload::run() {
  dispatcher_started();
  for (;;) {
    std::vector<AdamWArgs> args;
    uint64_t gen;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (stop_ && !busy_) return;
      args = args_;
      gen = gen_;
    }
    for (size_t i = 0; i < params_.size(); ++i) {
      before_update(i);
      const double t0 = now();
      update_param(i, args[i]);
      const double t1 = now();
      const double bytes = after_update(i);
      trace("update param " + std::to_string(params_[i].param), "host optimizer (dispatcher)", t0, t1);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.update_seconds += t1 - t0;
      stats_.bytes_to_device += bytes;
      done_gen_[i] = gen;
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    cv_.notify_all();
  }
}

void HostOffload::set_tracing(bool on) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  tracing_ = on;
}

std::vector<TraceEvent> HostOffload::take_trace(double t0) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  std::vector<TraceEvent> out = std::move(trace_);
  trace_.clear();
  for (TraceEvent& e : out) e.start -= t0;
  return out;
}

void HostOffload::trace(const std::string& name, const char* track, double start, double end) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  if (tracing_) trace_.push_back({name, "host optimizer", track, start, end - start});
}

namespace {

class CpuHostOffload final : public HostOffload {
 public:
  CpuHostOffload(Ops& ops, std::vector<HostParam> params, int threads)
      : HostOffload(std::move(params), threads), ops_(ops) {
    int64_t total = 0;
    for (const HostParam& p : params_) {
      MOP_CHECK(p.grad.dtype == DType::F32, "host optimizer on the CPU needs fp32 gradients");
      offsets_.push_back(total);
      total += p.grad.numel();
    }
    grads_ = Buffer(MemKind::Host, size_t(total) * sizeof(float));
    start();
  }
  ~CpuHostOffload() override { stop(); }

 private:
  Tensor staged_grad(size_t i) const {
    return Tensor(static_cast<float*>(grads_.data()) + offsets_[i], DType::F32,
                  {params_[i].grad.numel()});
  }

  double copy_grad(size_t i) override {
    std::memcpy(staged_grad(i).data, params_[i].grad.data, params_[i].grad.bytes());
    return 0;  // within host memory
  }

  void update_param(size_t i, const AdamWArgs& args) override {
    const HostParam& p = params_[i];
    host_adamw_run(pool_, host_adamw_range(p.master.view({p.master.numel()}), p.m.view({p.m.numel()}),
                                           p.v.view({p.v.numel()}), staged_grad(i)),
                   args);
    // Compute weights ← master: a plain copy for fp32 weights, a conversion otherwise.
    if (p.weights.dtype == DType::F32)
      std::memcpy(p.weights.data, p.master.data, p.master.bytes());
    else
      ops_.copy(p.weights, p.master);
  }

  Ops& ops_;
  std::vector<int64_t> offsets_;
  Buffer grads_;  // gradients copied aside, one range per parameter
};

}  // namespace

std::unique_ptr<HostOffload> make_cpu_host_offload(Ops& ops, std::vector<HostParam> params,
                                                   int threads) {
  return std::make_unique<CpuHostOffload>(ops, std::move(params), threads);
}

}  // namespace mop
