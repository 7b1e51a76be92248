// In-process ranks: ParallelGroups built over threads of one process, and the bytes the in-process
// comm gives against those of MPI ranks for the same inputs (each MPI rank runs the whole
// in-process world beside its MPI collectives).
#include <mpi.h>

#include <cmath>
#include <cstring>
#include <vector>

#include "catch.h"
#include "core/rng.h"
#include "ops/ops.h"
#include "parallel/groups.h"
#include "parallel/inprocess_comm.h"
#include "parallel/mpi_comm.h"

using namespace mop;

TEST_CASE("groups: built in-process for 4 ranks, cp 2 and ep 2", "[cpu]") {
  MeshDims d;
  d.dp = 2, d.cp = 2, d.edp = 2, d.ep = 2;
  const Mesh mesh(4, d);
  auto world = make_inprocess_world(4);
  std::vector<std::unique_ptr<ParallelGroups>> groups(4);
  const Axes cp{Axis::Cp}, ep{Axis::Ep};
  // Per rank: the sums of the world ranks over its world, cp, ep and edp groups (host and data
  // comms); the dense replicas (dp × cp) are the world's comms with one stage.
  std::vector<std::vector<double>> sums(4);
  run_inprocess(4, [&](int rank) {
    auto ops = make_ops(Device::CPU);
    auto comms = make_inprocess_comm_factory(world, rank);
    auto g = ParallelGroups::build(mesh, *comms, 60, *ops);
    std::vector<double>& s = sums[size_t(rank)];
    for (Axes axes : {kWorldAxes, cp, ep, kExpertReplicas})
      s.push_back(g->host(axes).all_reduce_host(double(rank), Comm::Op::Sum));
    for (Axes axes : {kWorldAxes, cp, ep, kExpertReplicas}) {
      float x = float(rank);
      g->data(axes).all_reduce_sum(Tensor(&x, DType::F32, {1}));
      s.push_back(x);
    }
    groups[size_t(rank)] = std::move(g);
  });
  for (int r = 0; r < 4; ++r) {
    INFO("rank " << r);
    const ParallelGroups& g = *groups[size_t(r)];
    CHECK((g.rank() == r && g.size() == 4));
    CHECK((g.size(Axis::Cp) == 2 && g.size(Axis::Dp) == 2 && g.size(Axis::Ep) == 2 &&
           g.size(Axis::Edp) == 2));
    // rank = dp·2 + cp = edp·2 + ep
    const int g_cp = g.coord(Axis::Cp), g_dp = g.coord(Axis::Dp), g_ep = g.coord(Axis::Ep),
              g_edp = g.coord(Axis::Edp);
    CHECK((g_cp == r % 2 && g_dp == r / 2 && g_ep == r % 2 && g_edp == r / 2));
    CHECK((g.world_host().size() == 4 && g.world_host().rank() == r));
    CHECK(&g.world_host() == &g.host(kWorldAxes));
    CHECK(&g.data(kDenseReplicas) == &g.data(kWorldAxes));
    for (const Comm* c : {&g.host(cp), &g.data(cp)}) CHECK((c->size() == 2 && c->rank() == g_cp));
    for (const Comm* c : {&g.host(ep), &g.data(ep)}) CHECK((c->size() == 2 && c->rank() == g_ep));
    for (const Comm* c : {&g.host(kExpertReplicas), &g.data(kExpertReplicas)})
      CHECK((c->size() == 2 && c->rank() == g_edp));
    CHECK((g.data(kWorldAxes).size() == 4 && g.data(kWorldAxes).rank() == r));
    CHECK(g.host(cp).name() == "inprocess");
    // CPU ranks: no side comms; every comm watched.
    for (CommKind k : {CommKind::GradSums, CommKind::Gathers, CommKind::Ring, CommKind::Dispatch,
                       CommKind::Combine})
      for (Axes axes : {kDenseReplicas, kExpertReplicas, cp, ep}) CHECK(!g.side(k, axes));
    REQUIRE(g.watchdog);
    CHECK(g.watchdog->num_collectives() == 8);
    // Members: cp {2·dp, 2·dp + 1}, ep {2·edp, 2·edp + 1}, edp {ep, ep + 2}.
    const double world_sum = 6, cp_sum = 4 * g_dp + 1, ep_sum = 4 * g_edp + 1,
                 edp_sum = 2 * g_ep + 2;
    CHECK(sums[size_t(r)] == std::vector<double>{world_sum, cp_sum, ep_sum, edp_sum, world_sum,
                                                 cp_sum, ep_sum, edp_sum});
  }
}

namespace {

// Outputs of one rank for the inputs below: random and small-integer float sums, a host sum of
// random doubles, a gather and an exchange.
struct Outputs {
  std::vector<float> random_sum, random_scatter, integer_sum;
  std::vector<double> host_sum;
  std::vector<int32_t> gathered, exchanged;
};

constexpr int64_t kElems = 1009;  // a prime: no vector width divides it
// Random floats summed over more than 2 ranks may be added in another order by Open MPI (its
// algorithm depends on the size), so they agree to rounding only: a few ulps of the terms' size.
constexpr double kReorderTol = 1e-5;

float random_value(int rank, int64_t i) {
  return float(philox_normal(17, uint64_t(rank), uint64_t(i)));
}

Outputs run_collectives(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  Outputs o;
  o.random_sum.resize(kElems), o.integer_sum.resize(kElems), o.random_scatter.resize(7);
  for (int64_t i = 0; i < kElems; ++i)
    o.random_sum[size_t(i)] = random_value(me, i),
    o.integer_sum[size_t(i)] = float((me * 7 + i) % 13 - 6);
  comm.all_reduce_sum(Tensor(o.random_sum.data(), DType::F32, {kElems}));
  comm.all_reduce_sum(Tensor(o.integer_sum.data(), DType::F32, {kElems}));
  std::vector<float> full(size_t(7 * R));
  for (int i = 0; i < 7 * R; ++i) full[size_t(i)] = random_value(me + 100, i);
  comm.reduce_scatter_sum(Tensor(o.random_scatter.data(), DType::F32, {7}),
                          Tensor(full.data(), DType::F32, {7 * R}));
  for (int i = 0; i < 5; ++i) o.host_sum.push_back(double(random_value(me + 200, i)) / 3);
  comm.all_reduce_host(o.host_sum.data(), 5, Comm::Op::Sum);
  std::vector<int32_t> mine = {me, me * 3, -me};
  o.gathered.resize(size_t(3 * R));
  comm.all_gather(Tensor(o.gathered.data(), DType::I32, {3 * R}),
                  Tensor(mine.data(), DType::I32, {3}));
  // Rank s sends s + d + 1 rows of 2 to rank d.
  std::vector<int64_t> send(static_cast<size_t>(R)), recv(static_cast<size_t>(R));
  int64_t ns = 0, nr = 0;
  for (int r = 0; r < R; ++r)
    ns += send[size_t(r)] = me + r + 1, nr += recv[size_t(r)] = r + me + 1;
  std::vector<int32_t> in(size_t(2 * ns));
  for (int64_t i = 0; i < 2 * ns; ++i) in[size_t(i)] = int32_t(me * 1000 + i);
  o.exchanged.assign(size_t(2 * nr), -1);
  comm.all_to_all_v(Tensor(o.exchanged.data(), DType::I32, {nr, 2}), recv,
                    Tensor(in.data(), DType::I32, {ns, 2}), send);
  return o;
}

template <class T>
bool same_bytes(const std::vector<T>& a, const std::vector<T>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(T)) == 0;
}

template <class T>
int num_far(const std::vector<T>& a, const std::vector<T>& b) {
  int far = 0;
  for (size_t i = 0; i < a.size(); ++i) far += std::abs(double(a[i]) - double(b[i])) > kReorderTol;
  return far;
}

}  // namespace

TEST_CASE("comm: MPI ranks and in-process ranks give the same bytes", "[mpi]") {
  auto mpi = make_mpi_comm(MPI_COMM_WORLD);
  const int R = mpi->size(), me = mpi->rank();
  const Outputs want = run_collectives(*mpi);
  auto comms = make_inprocess_comms(R);
  std::vector<Outputs> got(static_cast<size_t>(R));
  run_inprocess(R, [&](int rank) { got[size_t(rank)] = run_collectives(*comms[size_t(rank)]); });
  const Outputs& o = got[size_t(me)];
  CHECK(same_bytes(o.integer_sum, want.integer_sum));
  CHECK(same_bytes(o.gathered, want.gathered));
  CHECK(same_bytes(o.exchanged, want.exchanged));
  if (R == 2) {
    // x0 + x1 is exact-same in either order: bitwise.
    CHECK(same_bytes(o.random_sum, want.random_sum));
    CHECK(same_bytes(o.random_scatter, want.random_scatter));
    CHECK(same_bytes(o.host_sum, want.host_sum));
  } else {
    CHECK(num_far(o.random_sum, want.random_sum) == 0);
    CHECK(num_far(o.random_scatter, want.random_scatter) == 0);
    CHECK(num_far(o.host_sum, want.host_sum) == 0);
  }
}
