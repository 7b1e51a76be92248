// HostPipeline's shared pipeline (dispatcher thread, rounds, waits, stats, trace) and the CPU
// backend: gradients are copied aside when final (so the next step may zero them) and the
// dispatcher writes each parameter's compute weights itself.
#include "schedule/host_pipeline.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <utility>

#include "optim/host_adamw.h"
#include "runtime/memory.h"

namespace mop {

namespace {
double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

HostPipeline::HostPipeline(std::vector<HostParam> params, int threads)
    : params_(std::move(params)), pool_(threads), copied_(params_.size(), false),
      done_gen_(params_.size(), 0), state_gen_(params_.size(), 0) {}

HostPipeline::~HostPipeline() {
  if (dispatcher_.joinable()) {  // a backend that did not stop() its dispatcher: a bug
    std::fprintf(stderr, "internal error: HostPipeline destroyed with its dispatcher running\n");
    std::abort();
  }
}

void HostPipeline::start() { dispatcher_ = std::thread([this] { run(); }); }

void HostPipeline::stop() {
  if (!dispatcher_.joinable()) return;
  {
    std::lock_guard<std::mutex> lock(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  dispatcher_.join();
}

void HostPipeline::grads_final(int segment, const GradSource& grad) {
  bool begun = false;
  for (size_t i = 0; i < params_.size(); ++i)
    if (params_[i].segment == segment && !copied_[i]) {
      if (!std::exchange(begun, true)) begin_copies(segment);
      const double t0 = now();
      {  // the previous round's state pass may still read the gradient staging
        std::unique_lock<std::mutex> lock(mu_);
        cv_.wait(lock, [&] { return state_gen_[i] >= gen_; });
      }
      const double t1 = now();
      if (t1 - t0 > 1e-5) {
        trace("wait state param " + std::to_string(params_[i].param), "main thread (waits)", t0, t1);
        std::lock_guard<std::mutex> lock(mu_);
        stats_.wait_seconds += t1 - t0;
        gate_seconds_ += t1 - t0;
      }
      Tensor g = params_[i].grad;
      if (!g.data) {
        MOP_CHECK(bool(grad), "the streamed gradient of parameter ", params_[i].param, " was not handed over");
        g = grad(params_[i].param);
      }
      const double bytes = copy_grad(i, g);
      copied_[i] = true;
      std::lock_guard<std::mutex> lock(mu_);
      stats_.bytes_to_host += bytes;
    }
  if (begun) end_copies(segment);
}

void HostPipeline::update(const std::vector<AdamWArgs>& args, bool overlap) {
  MOP_CHECK(args.size() == params_.size(), "host update arguments");
  drain();  // one round at a time
  for (const HostParam& p : params_) grads_final(p.segment);  // those not final yet
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (gen_ > 0) cost_[two_pass_] = round_seconds_ + (two_pass_ ? gate_seconds_ : 0);
    gate_seconds_ = 0;
    args_ = args;
    two_pass_ = overlap && choose_two_pass(gen_ + 1, cost_[0], cost_[1]);
    ++gen_;
    busy_ = true;
  }
  std::fill(copied_.begin(), copied_.end(), false);
  cv_.notify_all();
  if (!overlap) drain();
}

bool HostPipeline::choose_two_pass(uint64_t round, double one_pass_cost, double two_pass_cost) {
  if (round <= 1 || two_pass_cost < 0) return true;
  if (one_pass_cost < 0) return false;
  const bool best = two_pass_cost <= one_pass_cost;
  return round % kProbeEvery == 0 ? !best : best;
}

void HostPipeline::discard_grads() { std::fill(copied_.begin(), copied_.end(), false); }

void HostPipeline::weights_ready(int segment) {
  const double t0 = now();
  std::vector<size_t> updated;  // the segment's parameters updated at least once
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].segment == segment && done_gen_[i] < gen_) return false;
      return true;
    });
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].segment == segment && done_gen_[i] > 0) updated.push_back(i);
  }
  for (size_t i : updated) weights_used(i);
  const double t1 = now();
  if (t1 - t0 > 1e-5) trace("wait segment " + std::to_string(segment), "main thread (waits)", t0, t1);
  std::lock_guard<std::mutex> lock(mu_);
  stats_.wait_seconds += t1 - t0;
}

void HostPipeline::drain() {
  const double t0 = now();
  {
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
  }
  drained();
  std::lock_guard<std::mutex> lock(mu_);
  stats_.wait_seconds += now() - t0;
}

OffloadStats HostPipeline::take_stats() {
  std::lock_guard<std::mutex> lock(mu_);
  OffloadStats s = stats_;
  stats_ = OffloadStats{};
  return s;
}

void HostPipeline::run() {
  dispatcher_started();
  for (;;) {
    std::vector<AdamWArgs> args;
    uint64_t gen;
    bool two_pass;
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return stop_ || busy_; });
      if (stop_ && !busy_) return;
      args = args_;
      gen = gen_;
      two_pass = two_pass_;
    }
    const double round_start = now();
    for (size_t i = 0; i < params_.size(); ++i) {
      before_update(i);
      const double t0 = now();
      update_param(i, args[i], two_pass ? Pass::Weights : Pass::Both);
      const double t1 = now();
      const double bytes = after_update(i);
      trace("update param " + std::to_string(params_[i].param), "host optimizer (dispatcher)", t0, t1);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.update_seconds += t1 - t0;
      stats_.bytes_to_device += bytes;
      done_gen_[i] = gen;
      if (!two_pass) state_gen_[i] = gen;
      cv_.notify_all();
    }
    {
      std::lock_guard<std::mutex> lock(mu_);
      round_seconds_ = now() - round_start;  // with the waits for gradients: the step sees them
    }
    for (size_t i = 0; two_pass && i < params_.size(); ++i) {
      const double t0 = now();
      update_param(i, args[i], Pass::State);
      const double t1 = now();
      trace("state param " + std::to_string(params_[i].param), "host optimizer (dispatcher)", t0, t1);
      std::lock_guard<std::mutex> lock(mu_);
      stats_.state_seconds += t1 - t0;
      state_gen_[i] = gen;
      cv_.notify_all();
    }
    std::lock_guard<std::mutex> lock(mu_);
    busy_ = false;
    cv_.notify_all();
  }
}

void HostPipeline::set_tracing(bool on) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  tracing_ = on;
}

std::vector<TraceEvent> HostPipeline::take_trace(double t0) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  std::vector<TraceEvent> out = std::move(trace_);
  trace_.clear();
  for (TraceEvent& e : out) e.start -= t0;
  return out;
}

void HostPipeline::trace(const std::string& name, const char* track, double start, double end) {
  std::lock_guard<std::mutex> lock(trace_mu_);
  if (tracing_) trace_.push_back({name, "host optimizer", track, start, end - start});
}

namespace {

class CpuHostPipeline final : public HostPipeline {
 public:
  CpuHostPipeline(std::vector<HostParam> params, int threads)
      : HostPipeline(std::move(params), threads) {
    int64_t total = 0;
    for (const HostParam& p : params_) {
      MOP_CHECK(p.grad.dtype == DType::F32, "host optimizer on the CPU needs fp32 gradients");
      offsets_.push_back(total);
      total += p.grad.numel();
    }
    grads_ = Buffer(MemKind::Host, size_t(total) * sizeof(float));
    start();
  }
  ~CpuHostPipeline() override { stop(); }
  size_t host_staging_bytes() const override { return grads_.bytes(); }

 private:
  Tensor staged_grad(size_t i) const {
    return Tensor(static_cast<float*>(grads_.data()) + offsets_[i], DType::F32,
                  {params_[i].grad.numel()});
  }

  double copy_grad(size_t i, const Tensor& grad) override {
    MOP_CHECK(grad.numel() == params_[i].grad.numel() && grad.dtype == DType::F32, "host gradient copy");
    std::memcpy(staged_grad(i).data, grad.data, grad.bytes());
    return 0;  // within host memory
  }

  // The kernel writes the compute weights itself (fp32: the new master; bf16: rounded).
  void update_param(size_t i, const AdamWArgs& args, Pass pass) override {
    const HostParam& p = params_[i];
    const Tensor weights = pass == Pass::State ? Tensor() : p.weights.view({p.weights.numel()});
    HostAdamWRange r = host_adamw_range(p.master.view({p.master.numel()}), p.m.view({p.m.numel()}),
                                        p.v.view({p.v.numel()}), staged_grad(i), weights);
    r.write_state = pass != Pass::Weights;
    host_adamw_run(pool_, r, args);
  }

  std::vector<int64_t> offsets_;
  Buffer grads_;  // gradients copied aside, one range per parameter
};

}  // namespace

std::unique_ptr<HostPipeline> make_cpu_host_pipeline(std::vector<HostParam> params, int threads) {
  return std::make_unique<CpuHostPipeline>(std::move(params), threads);
}

std::unique_ptr<HostPipeline> make_host_pipeline(Ops& ops, std::vector<HostParam> params, int threads) {
  if (params.empty()) return nullptr;
  if (ops.device() == Device::CPU) return make_cpu_host_pipeline(std::move(params), threads);
  return make_staged_host_pipeline(ops, std::move(params), threads);
}

}  // namespace mop
