// HostPipeline for a device backend (the pipeline is HostPipeline's), written against the
// runtime.
// Streams: the backend's compute stream converts each final fp32 gradient to bf16 (device
// staging) and records `converted`; the copy stream moves it to pinned host memory and records
// `on_host`; the dispatcher thread waits for that event, runs the host AdamW (writing bf16 weights
// to pinned staging), queues their upload on the upload stream piece by piece as the update
// writes them, and records `uploaded`; weights_ready() makes the compute stream wait for
// `uploaded`. A parameter's host weights staging is rewritten only in the next round, after the
// next forward has waited for its upload.
#include <algorithm>

#include "optim/host_adamw.h"
#include "runtime/memory.h"
#include "schedule/host_pipeline.h"
#include "runtime/runtime.h"

namespace mop {

namespace {

class StagedHostPipeline final : public HostPipeline {
 public:
  StagedHostPipeline(Ops& ops, std::vector<HostParam> params, int threads)
      : HostPipeline(std::move(params), threads), ops_(ops), compute_(ops.stream()),
        device_(compute_.device()), copy_(device_), upload_(device_) {
    MOP_CHECK(!compute_.is_null(), "the staged host optimizer needs a device backend");
    gpu_ = current_gpu();
    int64_t total = 0;
    streamed_ = !params_.empty() && !params_[0].grad.data;
    std::vector<int64_t> in_segment;  // streamed: elements so far, per segment
    for (const HostParam& p : params_) {
      MOP_CHECK(p.grad.device == device_ && p.weights.dtype == DType::BF16,
                "host optimizer on a device: device gradients and bf16 weights");
      MOP_CHECK(!p.grad.data == streamed_, "host optimizer: streamed and kept gradients mixed");
      const int64_t a = (p.grad.numel() + 63) / 64 * 64;  // keeps every slice 128-byte aligned
      offsets_.push_back(total);
      total += a;
      if (size_t(p.segment) >= in_segment.size()) in_segment.resize(size_t(p.segment) + 1, 0);
      dev_offsets_.push_back(streamed_ ? in_segment[size_t(p.segment)] : offsets_.back());
      in_segment[size_t(p.segment)] += a;
    }
    // Streamed: the bf16 conversions of one segment at a time, two buffers in turn, each reused
    // once its copy to the host is done; kept: one place per parameter.
    const int64_t largest = in_segment.empty() ? 0 : *std::max_element(in_segment.begin(), in_segment.end());
    staging_elems_ = streamed_ ? largest : total;
    grad_dev_ = Buffer(MemKind::Device, size_t(streamed_ ? 2 * largest : total) * 2);
    for (Event& e : staging_free_) e = Event(device_);
    grad_host_ = Buffer(MemKind::Pinned, size_t(total) * 2);
    weights_host_ = Buffer(MemKind::Pinned, size_t(total) * 2);
    events_.resize(params_.size());
    for (auto& e : events_)
      for (Event* ev : {&e.converted, &e.on_host, &e.uploaded}) *ev = Event(device_);
    start();
  }

  ~StagedHostPipeline() override {
    stop();
    copy_.get().synchronize();
    upload_.get().synchronize();
  }
  size_t device_staging_bytes() const override { return grad_dev_.bytes(); }
  size_t host_staging_bytes() const override { return grad_host_.bytes() + weights_host_.bytes(); }

 private:
  struct Events {
    Event converted, on_host, uploaded;
  };

  Tensor slice(const Buffer& b, size_t i, Device d) const {
    return Tensor(static_cast<uint16_t*>(b.data()) + offsets_[i], DType::BF16,
                  {params_[i].grad.numel()}, d);
  }

  void begin_copies(int segment) override {
    if (!streamed_) return;
    staging_ ^= 1;
    compute_.wait(staging_free_[staging_]);  // the segment before last's copies are done
  }

  void end_copies(int segment) override {
    if (streamed_) staging_free_[staging_].record(copy_.get());
  }

  // fp32 gradient → bf16 (compute stream) → pinned host memory (copy stream).
  double copy_grad(size_t i, const Tensor& grad) override {
    MOP_CHECK(grad.numel() == params_[i].grad.numel() && grad.device == device_, "host gradient copy");
    Tensor dev(static_cast<uint16_t*>(grad_dev_.data()) + (streamed_ ? staging_ * staging_elems_ : 0) + dev_offsets_[i],
               DType::BF16, {params_[i].grad.numel()}, device_);
    ops_.copy(dev, grad.view({grad.numel()}));
    events_[i].converted.record(compute_);
    copy_.get().wait(events_[i].converted);
    copy_async(slice(grad_host_, i, Device::CPU).data, dev.data, dev.bytes(), copy_.get());
    events_[i].on_host.record(copy_.get());
    return double(dev.bytes());
  }

  // The upload of this round is queued: later compute work waits for it.
  void weights_used(size_t i) override { compute_.wait(events_[i].uploaded); }

  void drained() override { upload_.get().synchronize(); }

  void dispatcher_started() override { select_gpu(gpu_); }

  void before_update(size_t i) override { events_[i].on_host.synchronize(); }

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
      copy_async(static_cast<bf16*>(p.weights.data) + b, r.weights + b, size_t(e - b) * sizeof(bf16),
                 upload_.get());
    }
  }

  double after_update(size_t i) override {
    events_[i].uploaded.record(upload_.get());
    return double(params_[i].weights.bytes());
  }

  // 32 MB of bf16 weights: 0.6 ms of upload, ~2 ms of update on 16 cores.
  static constexpr int64_t kUploadPiece = int64_t(1) << 24;

  Ops& ops_;
  Stream compute_;
  Device device_;
  int gpu_ = 0;
  std::vector<int64_t> offsets_;  // elements, per parameter, in the host staging buffers
  std::vector<int64_t> dev_offsets_;  // in the device staging (streamed: in its segment's buffer)
  Buffer grad_dev_, grad_host_, weights_host_;  // bf16
  bool streamed_ = false;
  int64_t staging_elems_ = 0;  // streamed: elements of each of the two device buffers
  int staging_ = 1;            // streamed: the buffer of the segment being copied
  Event staging_free_[2];      // streamed: each buffer's last copy to the host done
  OwnedStream copy_, upload_;
  std::vector<Events> events_;
};

}  // namespace

std::unique_ptr<HostPipeline> make_staged_host_pipeline(Ops& ops, std::vector<HostParam> params,
                                                        int threads) {
  return std::make_unique<StagedHostPipeline>(ops, std::move(params), threads);
}

}  // namespace mop
