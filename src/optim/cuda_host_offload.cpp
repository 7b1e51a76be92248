// HostOffload on the GPU (the pipeline is HostOffload's). Streams: the backend's compute stream
// converts each final fp32 gradient to bf16 (device staging) and records `converted`; the copy
// stream moves it to pinned host memory and records `on_host`; the dispatcher thread waits for
// that event, runs the host AdamW (writing bf16 weights to pinned staging), queues their upload
// on the upload stream piece by piece as the update writes them, and records `uploaded`;
// weights_ready() makes the compute stream wait for `uploaded`. A parameter's host weights
// staging is rewritten only in the next round, after the next forward has waited for its upload.
#include <cuda_runtime.h>

#include <algorithm>

#include "core/cuda_check.h"
#include "core/memory.h"
#include "ops/cuda_ops.h"
#include "optim/host_adamw.h"
#include "optim/host_offload.h"

namespace mop {

namespace {

class CudaHostOffload final : public HostOffload {
 public:
  CudaHostOffload(CudaOps& ops, std::vector<HostParam> params, int threads)
      : HostOffload(std::move(params), threads), ops_(ops) {
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
    start();
  }

  ~CudaHostOffload() override {
    stop();
    cudaStreamSynchronize(copy_);
    cudaStreamSynchronize(upload_);
    for (auto& e : events_)
      for (cudaEvent_t ev : {e.converted, e.on_host, e.uploaded}) cudaEventDestroy(ev);
    cudaStreamDestroy(copy_);
    cudaStreamDestroy(upload_);
  }

 private:
  struct Events {
    cudaEvent_t converted = nullptr, on_host = nullptr, uploaded = nullptr;
  };

  Tensor slice(const Buffer& b, size_t i, Device d) const {
    return Tensor(static_cast<uint16_t*>(b.data()) + offsets_[i], DType::BF16,
                  {params_[i].grad.numel()}, d);
  }

  // fp32 gradient → bf16 (compute stream) → pinned host memory (copy stream).
  double copy_grad(size_t i) override {
    Tensor dev = slice(grad_dev_, i, Device::CUDA);
    ops_.copy(dev, params_[i].grad.view({params_[i].grad.numel()}));
    MOP_CUDA_CHECK(cudaEventRecord(events_[i].converted, ops_.stream()));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(copy_, events_[i].converted, 0));
    MOP_CUDA_CHECK(cudaMemcpyAsync(slice(grad_host_, i, Device::CPU).data, dev.data, dev.bytes(),
                                   cudaMemcpyDeviceToHost, copy_));
    MOP_CUDA_CHECK(cudaEventRecord(events_[i].on_host, copy_));
    return double(dev.bytes());
  }

  // The upload of this round is queued: later compute work waits for it.
  void weights_used(size_t i) override {
    MOP_CUDA_CHECK(cudaStreamWaitEvent(ops_.stream(), events_[i].uploaded, 0));
  }

  void drained() override { MOP_CUDA_CHECK(cudaStreamSynchronize(upload_)); }

  void dispatcher_started() override { cudaSetDevice(device_); }

  void before_update(size_t i) override { MOP_CUDA_CHECK(cudaEventSynchronize(events_[i].on_host)); }

  // With weights out, the parameter goes in pieces, each uploaded as soon as it is written, so
  // the upload of a large parameter (an expert tensor: 0.8 GB, 16 ms) overlaps its own update and
  // the forward waits only for the last piece.
  void update_param(size_t i, const AdamWArgs& args, Pass pass) override {
    const HostParam& p = params_[i];
    HostAdamWRange r = host_adamw_range(
        p.master.view({p.master.numel()}), p.m.view({p.m.numel()}), p.v.view({p.v.numel()}),
        slice(grad_host_, i, Device::CPU),
        pass == Pass::State ? Tensor() : slice(weights_host_, i, Device::CPU));
    r.write_state = pass != Pass::Weights;
    if (pass == Pass::State) return host_adamw_run(pool_, r, args);
    for (int64_t b = 0; b < r.n; b += kUploadPiece) {
      const int64_t e = std::min(r.n, b + kUploadPiece);
      host_adamw_run(pool_, r.slice(b, e), args);
      MOP_CUDA_CHECK(cudaMemcpyAsync(static_cast<bf16*>(p.weights.data) + b, r.weights + b,
                                     size_t(e - b) * sizeof(bf16), cudaMemcpyHostToDevice, upload_));
    }
  }

  double after_update(size_t i) override {
    MOP_CUDA_CHECK(cudaEventRecord(events_[i].uploaded, upload_));
    return double(params_[i].weights.bytes());
  }

  // 32 MB of bf16 weights: 0.6 ms of upload, ~2 ms of update on 16 cores.
  static constexpr int64_t kUploadPiece = int64_t(1) << 24;

  CudaOps& ops_;
  int device_ = 0;
  std::vector<int64_t> offsets_;       // elements, per parameter, in the three staging buffers
  Buffer grad_dev_, grad_host_, weights_host_;  // bf16
  cudaStream_t copy_ = nullptr, upload_ = nullptr;
  std::vector<Events> events_;
};

}  // namespace

std::unique_ptr<HostOffload> make_cuda_host_offload(Ops& ops, std::vector<HostParam> params,
                                                    int threads) {
  return std::make_unique<CudaHostOffload>(cuda_backend(ops, "the GPU host optimizer"),
                                           std::move(params), threads);
}

}  // namespace mop
