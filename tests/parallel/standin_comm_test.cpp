// Stand-in comms (mop emulate): each call fills what a real collective would deliver with this
// rank's own data, in the group's shapes; the expert exchange's counts come from the routing
// model, so an emulated rank's experts receive what that model sends them.
#include <numeric>

#include "catch.h"
#include "ops/ops.h"
#include "parallel/expert_dispatch.h"
#include "parallel/routing_model.h"
#include "parallel/standin_comm.h"

using namespace mop;

namespace {

std::vector<float> iota(int n, float from = 1) {
  std::vector<float> v(static_cast<size_t>(n));
  std::iota(v.begin(), v.end(), from);
  return v;
}

}  // namespace

TEST_CASE("stand-in comms: every call in its group's shapes, filled with this rank's data", "[cpu][emulate]") {
  auto job = std::make_shared<StandInJob>();
  job->rank = 5, job->size = 8;
  const Mesh mesh(8, MeshDims{1, 2, 4, 2, 4});
  auto f = make_standin_comm_factory(job);
  std::unique_ptr<Comm> cp = f->data(mesh.group(Axes{Axis::Cp}, 5), Device::CPU, Stream());
  REQUIRE(cp->size() == 4);
  REQUIRE(cp->rank() == 1);  // rank 5 = dp 1 · 4 + cp 1

  std::vector<float> in = iota(3), out(12, 0);
  cp->all_gather(Tensor(out.data(), DType::F32, {12}), Tensor(in.data(), DType::F32, {3}));
  for (int i = 0; i < 12; ++i) CHECK(out[size_t(i)] == in[size_t(i % 3)]);
  // Groups of other sizes (the copies double what is filled: 1, 2, 4, … and the rest).
  for (int n : {1, 3, 5, 7, 96}) {
    const Mesh m(n, MeshDims{1, n, 1, n, 1});
    auto job_n = std::make_shared<StandInJob>();
    job_n->rank = n - 1, job_n->size = n;
    std::unique_ptr<Comm> dp = make_standin_comm_factory(job_n)->data(
        m.group(Axes{Axis::Dp}, n - 1), Device::CPU, Stream());
    REQUIRE(dp->size() == n);
    std::vector<float> got(size_t(3 * n), 0);
    dp->all_gather(Tensor(got.data(), DType::F32, {3 * n}), Tensor(in.data(), DType::F32, {3}));
    for (int i = 0; i < 3 * n; ++i) CHECK(got[size_t(i)] == in[size_t(i % 3)]);
  }

  std::vector<float> whole = iota(12), mine(3, 0);
  cp->reduce_scatter_sum(Tensor(mine.data(), DType::F32, {3}), Tensor(whole.data(), DType::F32, {12}));
  CHECK(mine == std::vector<float>{4, 5, 6});  // this rank's chunk (cp rank 1)

  std::vector<float> x = iota(4);
  cp->all_reduce_sum(Tensor(x.data(), DType::F32, {4}));
  CHECK(x == iota(4));
  double v[3] = {2, 3, 4};
  cp->all_reduce_host(v, 1, Comm::Op::Sum);
  cp->all_reduce_host(v + 1, 1, Comm::Op::Max);
  cp->all_reduce_host(v + 2, 1, Comm::Op::Min);
  CHECK(v[0] == 8);  // four ranks, each contributing what this one does
  CHECK(v[1] == 3);
  CHECK(v[2] == 4);

  // All-to-all: 2 rows of width 2 to send; 5 rows arrive — this rank's rows, repeated.
  std::vector<float> send = iota(4), recv(14, -1);
  cp->all_to_all_v(Tensor(recv.data(), DType::F32, {7, 2}), {1, 0, 3, 1}, {0, 1, 1, 5},
                   Tensor(send.data(), DType::F32, {2, 2}), {1, 0, 1, 0}, {0, 1, 1, 2});
  CHECK(std::vector<float>(recv.begin(), recv.begin() + 12) ==
        std::vector<float>{1, 2, 1, 2, 3, 4, 1, 2, -1, -1, 1, 2});
  std::vector<float> ring(4, 0);
  cp->send_recv(Tensor(ring.data(), DType::F32, {4}), 0, Tensor(x.data(), DType::F32, {4}), 2);
  CHECK(ring == x);
  // Shapes are checked as a real comm's are.
  CHECK_THROWS(cp->all_gather(Tensor(out.data(), DType::F32, {11}), Tensor(in.data(), DType::F32, {3})));
  // A group this rank is not in.
  CHECK_THROWS(f->host(mesh.group(Axes{Axis::Cp}, 0)));
}

TEST_CASE("stand-in expert counts: this rank's own, every other rank's from the routing model",
          "[cpu][emulate]") {
  const int64_t E = 8, K = 2, T = 40;
  const RoutingModel zipf = RoutingModel::parse("zipf:1", E, K);
  auto job = std::make_shared<StandInJob>();
  job->rank = 1, job->size = 4;
  job->expert_counts = [&](int layer, int, int64_t rows, int64_t, int32_t* out) { zipf.counts(layer, rows / K, out); };
  const Mesh mesh(4, MeshDims{1, 4, 1, 1, 4});
  auto f = make_standin_comm_factory(job);
  std::unique_ptr<Comm> host = f->host(mesh.group(Axes{Axis::Ep}, 1));
  std::unique_ptr<Comm> data = f->data(mesh.group(Axes{Axis::Ep}, 1), Device::CPU, Stream());

  std::vector<int32_t> mine = {10, 10, 10, 10, 10, 10, 10, 10}, all(32, -1), want(8);
  host->all_gather_expert_counts(Tensor(all.data(), DType::I32, {32}), Tensor(mine.data(), DType::I32, {8}), 0);
  zipf.counts(0, T, want.data());
  for (int s = 0; s < 4; ++s) {
    std::vector<int32_t> got(all.begin() + s * E, all.begin() + (s + 1) * E);
    INFO("source " << s);
    CHECK(std::accumulate(got.begin(), got.end(), 0) == T * K);  // tokens × top_k from every rank
    CHECK(got == (s == 1 ? mine : want));
  }
  CHECK(want[0] > want[7]);

  // The dispatcher of ep rank 1 (experts 2, 3) receives what the model sends them from the three
  // other ranks, and its own rows.
  std::unique_ptr<Ops> ops = make_ops(Device::CPU, 0);
  ExpertDispatcher d(*data, *host, *ops, E, /*max_rows_in=*/4 * T * K);
  d.plan(mine.data(), 0);
  CHECK(d.rows_out() == T * K);
  CHECK(d.rows_in() == 3 * (want[2] + want[3]) + mine[2] + mine[3]);
  CHECK(RoutingModel::most_loaded(zipf, 4, T) == 0);

  // A routing model whose counts do not add up is refused.
  job->expert_counts = [](int, int, int64_t, int64_t E2, int32_t* out) { std::fill(out, out + E2, 1); };
  CHECK_THROWS(host->all_gather_expert_counts(Tensor(all.data(), DType::I32, {32}), Tensor(mine.data(), DType::I32, {8}), 0));
}
