// TimedComm (see timed_comm.h).
#include "parallel/timed_comm.h"

namespace mop {
namespace {

class TimedComm final : public Comm {
 public:
  TimedComm(std::unique_ptr<Comm> inner, TimedOps& timed) : inner_(std::move(inner)), timed_(timed) {}

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
  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    Scope s(timed_, "reduce_scatter_sum");
    inner_->reduce_scatter_sum(out, in);
  }
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                    const std::vector<int64_t>& send_counts) override {
    Scope s(timed_, "all_to_all_v");
    inner_->all_to_all_v(out, recv_counts, in, send_counts);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    Scope s(timed_, "send_recv");
    inner_->send_recv(out, src, in, dst);
  }
  void broadcast(Tensor x, int root) override {
    Scope s(timed_, "broadcast");
    inner_->broadcast(x, root);
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
};

}  // namespace

std::unique_ptr<Comm> time_comm(std::unique_ptr<Comm> inner, TimedOps& timed) {
  MOP_CHECK(inner != nullptr, "time_comm() of a null Comm");
  return std::make_unique<TimedComm>(std::move(inner), timed);
}

}  // namespace mop
