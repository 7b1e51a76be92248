// TimedComm (see timed_comm.h).
#include "parallel/timed_comm.h"

namespace mop {
namespace {

class TimedComm final : public Comm {
 public:
  TimedComm(std::unique_ptr<Comm> inner, TimedOps& timed, const std::string& label)
      : inner_(std::move(inner)), timed_(timed), join_name_("join " + label) {}

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }

  void all_reduce_sum(Tensor x) override {
    Scope s(timed_, "all_reduce_sum");
    inner_->all_reduce_sum(x);
  }
  void all_gather(Tensor out, const Tensor& in) override {
    Scope s(timed_, "all_gather");
    inner_->all_gather(out, in);
  }
  void all_gather_expert_counts(Tensor out, const Tensor& in, int moe_layer) override {
    Scope s(timed_, "all_gather");
    inner_->all_gather_expert_counts(out, in, moe_layer);
  }
  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    Scope s(timed_, "reduce_scatter_sum");
    inner_->reduce_scatter_sum(out, in);
  }
  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    Scope s(timed_, "all_to_all_v");
    inner_->all_to_all_v(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    Scope s(timed_, "send_recv");
    inner_->send_recv(out, src, in, dst);
  }
  // A host comm's send copies and returns; its recv waits for the message: both count. NCCL's
  // enqueue, and their waits show in join().
  void send(const Tensor& in, int dst, int tag) override {
    Scope s(timed_, "send");
    inner_->send(in, dst, tag);
  }
  void recv(Tensor out, int src, int tag) override {
    Scope s(timed_, "recv");
    inner_->recv(out, src, tag);
  }
  void broadcast(Tensor x, int root) override {
    Scope s(timed_, "broadcast");
    inner_->broadcast(x, root);
  }
  // The compute stream waiting for an asynchronous comm: the part of it not hidden by compute.
  void join() override {
    Scope s(timed_, join_name_.c_str());
    inner_->join();
  }
  void barrier() override { inner_->barrier(); }
  using Comm::all_reduce_host;
  void all_reduce_host(double* values, int n, Op op) override { inner_->all_reduce_host(values, n, op); }

 private:
  // Ends the interval also when the collective throws.
  struct Scope {
    TimedOps& t;
    Scope(TimedOps& timed, const char* call) : t(timed) { t.begin_comm(call); }
    ~Scope() { t.end_comm(); }
  };
  std::unique_ptr<Comm> inner_;
  TimedOps& timed_;
  const std::string join_name_;  // "join <label>": the trace's name for this comm's waits
};

}  // namespace

std::unique_ptr<Comm> time_comm(std::unique_ptr<Comm> inner, TimedOps& timed,
                                const std::string& label) {
  MOP_CHECK(inner != nullptr, "time_comm() of a null Comm");
  return std::make_unique<TimedComm>(std::move(inner), timed, label);
}

}  // namespace mop
