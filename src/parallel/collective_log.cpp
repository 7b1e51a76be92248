// Recording comms (see collective_log.h).
#include "parallel/collective_log.h"

#include "core/error.h"

namespace mop {

namespace {

std::string shape_of(const Tensor& t) { return std::string(dtype_name(t.dtype)) + t.shape_str(); }

class RecordingComm final : public Comm {
 public:
  RecordingComm(std::unique_ptr<Comm> inner, CollectiveLog& log, std::string label)
      : inner_(std::move(inner)), log_(log), label_(std::move(label)) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }

  void all_reduce_sum(Tensor x) override {
    note("all_reduce_sum " + shape_of(x));
    inner_->all_reduce_sum(x);
  }
  void all_gather(Tensor out, const Tensor& in) override {
    note("all_gather " + shape_of(out) + " <- " + shape_of(in));
    inner_->all_gather(out, in);
  }
  void all_gather_expert_counts(Tensor out, const Tensor& in, int moe_layer) override {
    note("all_gather_expert_counts layer " + std::to_string(moe_layer) + " " + shape_of(out) + " <- " + shape_of(in));
    inner_->all_gather_expert_counts(out, in, moe_layer);
  }
  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    note("reduce_scatter_sum " + shape_of(out) + " <- " + shape_of(in));
    inner_->reduce_scatter_sum(out, in);
  }
  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const std::vector<int64_t>& recv_offsets,
                    const Tensor& in, const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    note("all_to_all_v " + shape_of(out) + " <- " + shape_of(in));
    inner_->all_to_all_v(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    note("send_recv " + shape_of(out) + " <- " + shape_of(in) + " from " + std::to_string(src) + " to " +
         std::to_string(dst));
    inner_->send_recv(out, src, in, dst);
  }
  void send(const Tensor& in, int dst, int tag) override {
    note("send " + shape_of(in) + " to " + std::to_string(dst) + " tag " + std::to_string(tag));
    inner_->send(in, dst, tag);
  }
  void recv(Tensor out, int src, int tag) override {
    note("recv " + shape_of(out) + " from " + std::to_string(src) + " tag " + std::to_string(tag));
    inner_->recv(out, src, tag);
  }
  void broadcast(Tensor x, int root) override {
    note("broadcast " + shape_of(x) + " root " + std::to_string(root));
    inner_->broadcast(x, root);
  }
  void barrier() override {
    note("barrier");
    inner_->barrier();
  }
  using Comm::all_reduce_host;
  void all_reduce_host(double* values, int n, Op op) override {
    note("all_reduce_host " + std::to_string(n) + (op == Op::Sum ? " sum" : op == Op::Max ? " max" : " min"));
    inner_->all_reduce_host(values, n, op);
  }
  void join() override { inner_->join(); }

 private:
  void note(const std::string& call) { log_.add(label_ + " " + call); }
  std::unique_ptr<Comm> inner_;
  CollectiveLog& log_;
  std::string label_;
};

class RecordingFactory final : public CommFactory {
 public:
  RecordingFactory(std::unique_ptr<CommFactory> inner, CollectiveLog& log) : inner_(std::move(inner)), log_(log) {}
  int rank() const override { return inner_->rank(); }
  std::unique_ptr<Comm> host(const MeshGroup& group) override { return wrap(inner_->host(group), "host", group); }
  std::unique_ptr<Comm> data(const MeshGroup& group, Device device, Stream compute) override {
    return wrap(inner_->data(group, device, compute), "data", group);
  }
  std::unique_ptr<Comm> side(const MeshGroup& group, Stream stream, Stream compute) override {
    return wrap(inner_->side(group, stream, compute), "side", group);
  }
  void share_watchdog(CollectiveWatchdog& dog) override { inner_->share_watchdog(dog); }

 private:
  std::unique_ptr<Comm> wrap(std::unique_ptr<Comm> c, const char* kind, const MeshGroup& group) {
    return std::make_unique<RecordingComm>(
        std::move(c), log_,
        std::string(kind) + " " + group.name() + "(" + std::to_string(group.size()) + ")");
  }
  std::unique_ptr<CommFactory> inner_;
  CollectiveLog& log_;
};

}  // namespace

std::unique_ptr<CommFactory> record_collectives(std::unique_ptr<CommFactory> inner, CollectiveLog& log) {
  MOP_CHECK(inner != nullptr, "record_collectives() of a null factory");
  return std::make_unique<RecordingFactory>(std::move(inner), log);
}

}  // namespace mop
