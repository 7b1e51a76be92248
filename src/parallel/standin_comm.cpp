// Stand-in comms (see standin_comm.h).
#include "parallel/standin_comm.h"

#include <algorithm>
#include <numeric>

#include "core/error.h"
#include "runtime/runtime.h"

namespace mop {

namespace {

class StandInComm final : public Comm {
 public:
  // `stream`: where device copies run (null: host buffers only); `follow`: the compute stream an
  // asynchronous comm follows (null: none, the copies are ordered on `stream` itself).
  StandInComm(const MeshGroup& group, std::shared_ptr<const StandInJob> job, Stream stream,
              Stream follow)
      : job_(std::move(job)),
        rank_(group.index),
        size_(group.size()),
        name_(std::string("stand-in ") + group.name() + "(" + std::to_string(group.size()) + ")"),
        stream_(stream),
        follow_(follow) {
    if (!follow_.is_null() && !(follow_ == stream_)) {
      began_ = Event(stream_.device());
      done_ = Event(stream_.device());
    }
  }

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return name_; }

  void all_reduce_sum(Tensor) override {}
  void all_gather(Tensor out, const Tensor& in) override {
    MOP_CHECK(out.bytes() == in.bytes() * size_t(size_), name_, " all_gather sizes");
    begin();
    // The rank's own chunk in every place, in log2(size) + 1 copies (each doubling what is filled)
    // rather than one per rank: a group of 96 gathers each tensor in 8 copies instead of 96.
    char* o = static_cast<char*>(out.data);
    const size_t b = in.bytes();
    copy(o, in.data, b);
    for (size_t have = 1; have < size_t(size_); have *= 2) copy(o + have * b, o, std::min(have, size_t(size_) - have) * b);
  }
  void all_gather_expert_counts(Tensor out, const Tensor& in, int moe_layer) override {
    MOP_CHECK(in.dtype == DType::I32 && in.device == Device::CPU && out.numel() == in.numel() * size_,
              name_, " expert counts: host I32 [", size_, " × E]");
    const int64_t E = in.numel();
    const auto* mine = in.ptr<int32_t>();
    auto* all = out.ptr<int32_t>();
    const int64_t rows = std::accumulate(mine, mine + E, int64_t(0));
    for (int s = 0; s < size_; ++s) {
      int32_t* to = all + s * E;
      if (s == rank_ || !job_->expert_counts) {
        std::copy(mine, mine + E, to);
      } else {
        job_->expert_counts(moe_layer, s, rows, E, to);
        MOP_CHECK(std::accumulate(to, to + E, int64_t(0)) == rows, name_, ": the routing model's counts of rank ",
                  s, " do not sum to ", rows, " rows");
      }
    }
  }
  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    MOP_CHECK(in.bytes() == out.bytes() * size_t(size_), name_, " reduce_scatter sizes");
    begin();
    copy(out.data, static_cast<const char*>(in.data) + size_t(rank_) * out.bytes(), out.bytes());
  }
  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                    const Tensor& in, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    const size_t row = check_all_to_all(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
    const int64_t in_rows = in.shape.empty() ? 0 : in.shape[0];
    begin();
    if (in_rows == 0) return;  // nothing of our own to repeat: the buffer keeps what it held
    for (int r = 0; r < size_; ++r)
      for (int64_t done = 0; done < recv_counts[size_t(r)];) {
        const int64_t n = std::min(in_rows, recv_counts[size_t(r)] - done);
        copy(static_cast<char*>(out.data) + size_t(recv_offsets[size_t(r)] + done) * row, in.data, size_t(n) * row);
        done += n;
      }
  }
  void send_recv(Tensor out, int, const Tensor& in, int) override {
    MOP_CHECK(out.bytes() == in.bytes(), name_, " send_recv sizes");
    begin();
    copy(out.data, in.data, in.bytes());
  }
  void send(const Tensor&, int dst, int) override { check_message_peer("send", dst); }
  void recv(Tensor, int src, int) override { check_message_peer("recv", src); }
  void broadcast(Tensor, int root) override { MOP_CHECK(root >= 0 && root < size_, name_, " broadcast root ", root); }
  void barrier() override {}
  using Comm::all_reduce_host;
  void all_reduce_host(double* values, int n, Op op) override {
    if (op == Op::Sum)
      for (int i = 0; i < n; ++i) values[i] *= double(size_);
  }
  void join() override {
    if (!pending_) return;
    done_.record(stream_);
    follow_.wait(done_);
    pending_ = false;
  }

 private:
  // An asynchronous comm's copies start after the compute issued so far, as NCCL's would.
  void begin() {
    if (began_.native() == nullptr) return;
    began_.record(follow_);
    stream_.wait(began_);
    pending_ = true;
  }
  void copy(void* dst, const void* src, size_t bytes) {
    if (bytes && dst != src) copy_async(dst, src, bytes, stream_);
  }

  std::shared_ptr<const StandInJob> job_;
  int rank_, size_;
  std::string name_;
  Stream stream_, follow_;
  Event began_, done_;
  bool pending_ = false;
};

class StandInCommFactory final : public CommFactory {
 public:
  explicit StandInCommFactory(std::shared_ptr<const StandInJob> job) : job_(std::move(job)) {}
  int rank() const override { return job_->rank; }
  std::unique_ptr<Comm> host(const MeshGroup& group) override { return make(group, Stream(), Stream()); }
  std::unique_ptr<Comm> data(const MeshGroup& group, Device device, Stream compute) override {
    return make(group, device == Device::CPU ? Stream() : compute, Stream());
  }
  std::unique_ptr<Comm> side(const MeshGroup& group, Stream stream, Stream compute) override {
    MOP_CHECK(stream.device() == Device::CUDA, "side comms run on a GPU stream");
    return make(group, stream, compute);
  }

 private:
  std::unique_ptr<Comm> make(const MeshGroup& group, Stream stream, Stream follow) {
    MOP_CHECK(group.index >= 0 && group.index < group.size() && group.world_rank() == job_->rank,
              "rank ", job_->rank, " asked for a ", group.name(), " group it is not in");
    return std::make_unique<StandInComm>(group, job_, stream, follow);
  }
  std::shared_ptr<const StandInJob> job_;
};

}  // namespace

std::unique_ptr<CommFactory> make_standin_comm_factory(std::shared_ptr<const StandInJob> job) {
  MOP_CHECK(job && job->size >= 1 && job->rank >= 0 && job->rank < job->size, "a stand-in job's rank");
  return std::make_unique<StandInCommFactory>(std::move(job));
}

World standin_world(std::shared_ptr<const StandInJob> job, int ranks_per_node) {
  MOP_CHECK(job && ranks_per_node >= 1, "a stand-in world");
  World w;
  w.rank = job->rank, w.size = job->size;
  w.local_size = std::min(ranks_per_node, job->size);
  w.local_rank = job->rank % w.local_size;
  w.host = "emulated";
  w.comm = make_standin_comm_factory(job)->host(world_group(job->size, job->rank));
  w.standin = std::move(job);
  return w;
}

}  // namespace mop
