// TimedOps and TimedComm on the CPU: ops are timed under their category and phase, collectives
// (and the waits of asynchronous comms) under communication, forced categories leave
// communication alone, the trace names each interval, and intervals may not nest.
#include <thread>

#include "catch.h"
#include "core/error.h"
#include "ops/timed_ops.h"
#include "parallel/timed_comm.h"
#include "ops/ops_test_util.h"

using namespace mop;

namespace {

// A comm of one rank whose collectives take a known time (the self comm's take none).
class SlowComm final : public Comm {
 public:
  explicit SlowComm(double seconds) : inner_(make_self_comm()), seconds_(seconds) {}
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "slow"; }
  void all_reduce_sum(Tensor x) override { sleep(), inner_->all_reduce_sum(x); }
  void all_gather(Tensor out, const Tensor& in) override { inner_->all_gather(out, in); }
  void reduce_scatter_sum(Tensor out, const Tensor& in) override { inner_->reduce_scatter_sum(out, in); }
  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& rc, const std::vector<int64_t>& ro,
                    const Tensor& in, const std::vector<int64_t>& sc,
                    const std::vector<int64_t>& so) override {
    inner_->all_to_all_v(out, rc, ro, in, sc, so);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override { inner_->send_recv(out, src, in, dst); }
  void broadcast(Tensor x, int root) override { inner_->broadcast(x, root); }
  void barrier() override {}
  void join() override { sleep(); }
  using Comm::all_reduce_host;
  void all_reduce_host(double*, int, Op) override {}

 private:
  void sleep() const { std::this_thread::sleep_for(std::chrono::duration<double>(seconds_)); }
  std::unique_ptr<Comm> inner_;
  double seconds_;
};

}  // namespace

TEST_CASE("timed ops: categories, phases, communication, trace, no nesting", "[cpu][ops]") {
  TimedOps timed(make_cpu_ops());
  auto comm = time_comm(std::make_unique<SlowComm>(0.02), timed, "slow");
  test::HostTensor a(DType::F32, {64, 64}), b(DType::F32, {64, 64}), c(DType::F32, {64, 64});
  test::fill_random(a, 1, -1, 1);
  test::fill_random(b, 2, -1, 1);
  timed.start_trace();
  timed.set_phase(StepPhase::Backward);
  timed.gemm(c, a, false, b, true, 1, 0);
  comm->all_reduce_sum(c);  // 20 ms
  comm->join();             // 20 ms, the compute waiting for an asynchronous comm
  timed.force_category(OpCategory::Optimizer);
  timed.fill(c, 0);
  comm->all_reduce_sum(c);  // still communication
  timed.clear_forced_category();
  std::vector<TraceEvent> trace = timed.stop_trace();
  OpTimes t = timed.collect();
  const double comm_s = t.seconds[int(OpCategory::Communication)];
  CHECK(comm_s >= 0.06);
  CHECK(comm_s < 0.5);
  CHECK(t.seconds[int(OpCategory::DenseGemm)] > 0);
  CHECK(t.seconds[int(OpCategory::Optimizer)] > 0);
  CHECK(t.seconds[int(OpCategory::Other)] == 0);  // fill was forced into optimizer
  CHECK(t.phase_seconds[int(StepPhase::Backward)] == Approx(t.total()));
  std::vector<std::string> names;
  for (const TraceEvent& e : trace) names.push_back(e.name);
  CHECK(names == std::vector<std::string>{"gemm", "all_reduce_sum", "join slow", "fill", "all_reduce_sum"});
  // A collective issued inside another interval would be counted twice: refused.
  timed.begin_comm("outer");
  CHECK_THROWS_WITH(timed.begin_comm("inner"), Catch::Contains("inner begins inside outer"));
  timed.end_comm();
  timed.begin_comm("again");  // closed properly: usable again
  timed.end_comm();
}
