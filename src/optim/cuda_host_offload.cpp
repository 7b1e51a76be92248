// HostOffload on the GPU. Streams: the backend's compute stream converts each final fp32 gradient
// to bf16 (device staging) and records `converted`; the copy stream moves it to pinned host memory
// and records `on_host`; a dispatcher thread waits for that event, runs the host AdamW (writing
// bf16 weights to pinned staging), queues the upload on the upload stream and records `uploaded`;
// weights_ready() makes the compute stream wait for `uploaded`. A parameter's host weights staging
// is rewritten only in the next round, after the next forward has waited for its upload.
#include <cuda_runtime.h>

#include <chrono>
#include <condition_variable>
#include <mutex>
#include <thread>

#include "core/cuda_check.h"
#include "core/thread_pool.h"
#include "ops/cuda_ops.h"
#include "optim/host_adamw.h"
#include "optim/host_offload.h"

namespace mop {

namespace {

double now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

class CudaHostOffload final : public HostOffload {
 public:
  CudaHostOffload(CudaOps& ops, std::vector<HostParam> params, int threads)
      : ops_(ops), params_(std::move(params)), pool_(threads), done_gen_(params_.size(), 0) {
    MOP_CUDA_CHECK(cudaGetDevice(&device_));
    int64_t total = 0;
    for (const HostParam& p : params_) {
      MOP_CHECK(p.grad.device == Device::CUDA && p.weights.dtype == DType::BF16,
                "host optimizer on the GPU: device gradients and bf16 weights");
      offsets_.push_back(total);
      total += (p.grad.numel() + 63) / 64 * 64;  // keeps every slice 128-byte aligned
    }
    grad_dev_ = Buffer(MemKind::Device, size_t(total) * 2);
    grad_host_ = Buffer(MemKind::Pinned, size_t(total) * 2);
    weights_host_ = Buffer(MemKind::Pinned, size_t(total) * 2);
    MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking));
    MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&upload_, cudaStreamNonBlocking));
    events_.resize(params_.size());
    for (auto& e : events_)
      for (cudaEvent_t* ev : {&e.converted, &e.on_host, &e.uploaded})
        MOP_CUDA_CHECK(cudaEventCreateWithFlags(ev, cudaEventDisableTiming));
    copied_.assign(params_.size(), false);
    dispatcher_ = std::thread([this] { run(); });
  }

  ~CudaHostOffload() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    dispatcher_.join();
    cudaStreamSynchronize(copy_);
    cudaStreamSynchronize(upload_);
    for (auto& e : events_)
      for (cudaEvent_t ev : {e.converted, e.on_host, e.uploaded}) cudaEventDestroy(ev);
    cudaStreamDestroy(copy_);
    cudaStreamDestroy(upload_);
  }

  void grads_final(int stage) override {
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].stage == stage && !copied_[i]) copy_grad(i);
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
    if (!overlap)
      for (int s = 0; s <= params_.back().stage; ++s) weights_ready(s);
  }

  void weights_ready(int stage) override {
    double t0 = now();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] {
        for (size_t i = 0; i < params_.size(); ++i)
          if (params_[i].stage == stage && done_gen_[i] < gen_) return false;
        return true;
      });
    }
    // The upload events of this round are recorded: later compute work waits for them.
    for (size_t i = 0; i < params_.size(); ++i)
      if (params_[i].stage == stage && done_gen_[i] > 0)
        MOP_CUDA_CHECK(cudaStreamWaitEvent(ops_.stream(), events_[i].uploaded, 0));
    double t1 = now();
    if (t1 - t0 > 1e-5) trace("wait stage " + std::to_string(stage), "main thread (waits)", t0, t1);
    std::lock_guard<std::mutex> lock(mu_);
    stats_.wait_seconds += t1 - t0;
  }

  void drain() override {
    double t0 = now();
    {
      std::unique_lock<std::mutex> lock(mu_);
      cv_.wait(lock, [&] { return !busy_; });
    }
    MOP_CUDA_CHECK(cudaStreamSynchronize(upload_));
    std::lock_guard<std::mutex> lock(mu_);
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
  struct Events {
    cudaEvent_t converted = nullptr, on_host = nullptr, uploaded = nullptr;
  };

  Tensor slice(const Buffer& b, size_t i, Device d) const {
    return Tensor(static_cast<uint16_t*>(b.data()) + offsets_[i], DType::BF16,
                  {params_[i].grad.numel()}, d);
  }

  // fp32 gradient → bf16 (compute stream) → pinned host memory (copy stream).
  void copy_grad(size_t i) {
    Tensor dev = slice(grad_dev_, i, Device::CUDA);
    ops_.copy(dev, params_[i].grad.view({params_[i].grad.numel()}));
    MOP_CUDA_CHECK(cudaEventRecord(events_[i].converted, ops_.stream()));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(copy_, events_[i].converted, 0));
    MOP_CUDA_CHECK(cudaMemcpyAsync(slice(grad_host_, i, Device::CPU).data, dev.data, dev.bytes(),
                                   cudaMemcpyDeviceToHost, copy_));
    MOP_CUDA_CHECK(cudaEventRecord(events_[i].on_host, copy_));
    copied_[i] = true;
    std::lock_guard<std::mutex> lock(mu_);
    stats_.bytes_to_host += double(dev.bytes());
  }

  void run() {
    cudaSetDevice(device_);
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
        MOP_CUDA_CHECK(cudaEventSynchronize(events_[i].on_host));
        double t0 = now();
        Tensor weights = slice(weights_host_, i, Device::CPU);
        host_adamw_run(pool_,
                       host_adamw_range(p.master.view({p.master.numel()}), p.m.view({p.m.numel()}),
                                        p.v.view({p.v.numel()}), slice(grad_host_, i, Device::CPU),
                                        weights),
                       args[i]);
        double t1 = now();
        MOP_CUDA_CHECK(cudaMemcpyAsync(p.weights.data, weights.data, weights.bytes(),
                                       cudaMemcpyHostToDevice, upload_));
        MOP_CUDA_CHECK(cudaEventRecord(events_[i].uploaded, upload_));
        trace("update param " + std::to_string(p.param), "host optimizer (dispatcher)", t0, t1);
        std::lock_guard<std::mutex> lock(mu_);
        stats_.update_seconds += t1 - t0;
        stats_.bytes_to_device += double(weights.bytes());
        done_gen_[i] = gen;
        cv_.notify_all();
      }
      std::lock_guard<std::mutex> lock(mu_);
      busy_ = false;
      cv_.notify_all();
    }
  }

  CudaOps& ops_;
  std::vector<HostParam> params_;
  ThreadPool pool_;
  int device_ = 0;
  std::vector<int64_t> offsets_;       // elements, per parameter, in the three staging buffers
  Buffer grad_dev_, grad_host_, weights_host_;  // bf16
  cudaStream_t copy_ = nullptr, upload_ = nullptr;
  std::vector<Events> events_;
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

std::unique_ptr<HostOffload> make_cuda_host_offload(Ops& ops, std::vector<HostParam> params,
                                                    int threads) {
  return std::make_unique<CudaHostOffload>(cuda_backend(ops, "the GPU host optimizer"),
                                           std::move(params), threads);
}

}  // namespace mop
