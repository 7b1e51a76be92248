// HostOffload on CPU runs: gradients are copied aside when final (so the next step may zero them),
// a dispatcher thread runs each parameter's host AdamW on the worker pool in forward order and
// then writes its compute weights; weights_ready() waits for a stage's parameters.
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <thread>

#include "core/memory.h"
#include "core/thread_pool.h"
#include "optim/host_adamw.h"
#include "optim/host_offload.h"

namespace mop {

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

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class CpuHostOffload final : public HostOffload {
 public:
  CpuHostOffload(Ops& ops, std::vector<HostParam> params, int threads)
      : ops_(ops), params_(std::move(params)), pool_(threads), done_gen_(params_.size(), 0) {
    int64_t total = 0;
    for (const HostParam& p : params_) {
      MOP_CHECK(p.grad.dtype == DType::F32, "host optimizer on the CPU needs fp32 gradients");
      offsets_.push_back(total);
      total += p.grad.numel();
    }
    grads_ = Buffer(MemKind::Host, size_t(total) * sizeof(float));
    copied_.assign(params_.size(), false);
    dispatcher_ = std::thread([this] { run(); });
  }

  ~CpuHostOffload() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    dispatcher_.join();
  }

  void grads_final(int stage) override {
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].stage == stage) copy_grad(i);
  }

  void update(const std::vector<AdamWArgs>& args, bool overlap) override {
    MOP_CHECK(args.size() == params_.size(), "host update arguments");
    drain();  // one round at a time
    for (size_t i = 0; i < params_.size(); ++i)
      if (!copied_[i]) copy_grad(i);
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

  void weights_ready(int stage) override {
    double t0 = now();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] {
      for (size_t i = 0; i < params_.size(); ++i)
        if (params_[i].stage == stage && done_gen_[i] < gen_) return false;
      return true;
    });
    double t1 = now();
    stats_.wait_seconds += t1 - t0;
    lock.unlock();
    if (t1 - t0 > 1e-5) trace("wait stage " + std::to_string(stage), "main thread (waits)", t0, t1);
  }

  void drain() override {
    double t0 = now();
    std::unique_lock<std::mutex> lock(mu_);
    cv_.wait(lock, [&] { return !busy_; });
    stats_.wait_seconds += now() - t0;
  }

  OffloadStats take_stats() override {
    std::lock_guard<std::mutex> lock(mu_);
    OffloadStats s = stats_;
    stats_ = OffloadStats{};
    return s;
  }

  const std::vector<HostParam>& params() const override { return params_; }

 private:
  Tensor staged_grad(size_t i) const {
    return Tensor(static_cast<float*>(grads_.data()) + offsets_[i], DType::F32,
                  {params_[i].grad.numel()});
  }

  void copy_grad(size_t i) {
    std::memcpy(staged_grad(i).data, params_[i].grad.data, params_[i].grad.bytes());
    copied_[i] = true;
  }

  void run() {
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
        const HostParam& p = params_[i];
        double t0 = now();
        host_adamw_run(pool_, host_adamw_range(p.master.view({p.master.numel()}),
                                               p.m.view({p.m.numel()}), p.v.view({p.v.numel()}),
                                               staged_grad(i)),
                       args[i]);
        // Compute weights ← master: a plain copy for fp32 weights, a conversion otherwise.
        if (p.weights.dtype == DType::F32)
          std::memcpy(p.weights.data, p.master.data, p.master.bytes());
        else
          ops_.copy(p.weights, p.master);
        double t1 = now();
        trace("update param " + std::to_string(p.param), "host optimizer (dispatcher)", t0, t1);
        std::lock_guard<std::mutex> lock(mu_);
        stats_.update_seconds += t1 - t0;
        done_gen_[i] = gen;
        cv_.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      cv_.notify_all();
    }
  }

  Ops& ops_;
  std::vector<HostParam> params_;
  ThreadPool pool_;
  std::vector<int64_t> offsets_;
  Buffer grads_;              // gradients copied aside, one range per parameter
  std::vector<bool> copied_;  // main thread only
  std::mutex mu_;
  std::condition_variable cv_;
  std::vector<AdamWArgs> args_;
  std::vector<uint64_t> done_gen_;
  uint64_t gen_ = 0;
  bool busy_ = false, stop_ = false;
  OffloadStats stats_;
  std::thread dispatcher_;
};

}  // namespace

std::unique_ptr<HostOffload> make_cpu_host_offload(Ops& ops, std::vector<HostParam> params,
                                                   int threads) {
  return std::make_unique<CpuHostOffload>(ops, std::move(params), threads);
}

}  // namespace mop
