// Comm over MPI on CPU ranks (run under mpirun -np 2 and -np 4): every collective checked exactly
// with payloads that encode the source rank and element index.
#include <mpi.h>

#include <numeric>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "parallel/mpi_comm.h"

using namespace mop;

TEST_CASE("comm: MPI collectives move exactly what they should", "[mpi]") {
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  const int R = comm->size(), me = comm->rank();
  REQUIRE(R >= 2);

  SECTION("all_reduce_sum") {
    std::vector<double> x(1000);
    for (int i = 0; i < 1000; ++i) x[i] = me * 1000 + i;
    comm->all_reduce_sum(Tensor(x.data(), DType::F64, {1000}));
    int wrong = 0;
    for (int i = 0; i < 1000; ++i) wrong += x[i] != double(R * i + 1000 * (R * (R - 1) / 2));
    CHECK(wrong == 0);
  }
  SECTION("all_gather and reduce_scatter") {
    std::vector<int32_t> in(5), out(5 * R);
    for (int i = 0; i < 5; ++i) in[i] = me * 100 + i;
    comm->all_gather(Tensor(out.data(), DType::I32, {5 * R}), Tensor(in.data(), DType::I32, {5}));
    int wrong = 0;
    for (int r = 0; r < R; ++r)
      for (int i = 0; i < 5; ++i) wrong += out[r * 5 + i] != r * 100 + i;
    CHECK(wrong == 0);
    std::vector<float> full(3 * R), part(3);
    for (int i = 0; i < 3 * R; ++i) full[i] = float(me + i);
    comm->reduce_scatter_sum(Tensor(part.data(), DType::F32, {3}), Tensor(full.data(), DType::F32, {3 * R}));
    for (int i = 0; i < 3; ++i) CHECK(part[i] == float(R * (me * 3 + i) + R * (R - 1) / 2));
  }
  SECTION("all_to_all_v with variable counts and a rank that receives nothing") {
    // Rank s sends (s + d) % 3 rows to rank d, except that nobody sends to the last rank.
    const int W = 4;
    auto count = [&](int s, int d) { return d == R - 1 ? 0 : (s + d) % 3; };
    std::vector<int64_t> send(R), recv(R);
    int64_t ns = 0, nr = 0;
    for (int d = 0; d < R; ++d) ns += send[d] = count(me, d);
    for (int s = 0; s < R; ++s) nr += recv[s] = count(s, me);
    std::vector<int32_t> in(std::max<int64_t>(ns, 1) * W), out(std::max<int64_t>(nr, 1) * W, -1);
    int64_t row = 0;
    for (int d = 0; d < R; ++d)
      for (int j = 0; j < send[d]; ++j, ++row)
        for (int c = 0; c < W; ++c) in[row * W + c] = me * 10000 + d * 100 + j * 10 + c;
    comm->all_to_all_v(Tensor(out.data(), DType::I32, {std::max<int64_t>(nr, 1), W}), recv,
                       Tensor(in.data(), DType::I32, {std::max<int64_t>(ns, 1), W}), send);
    int wrong = 0;
    row = 0;
    for (int s = 0; s < R; ++s)
      for (int j = 0; j < recv[s]; ++j, ++row)
        for (int c = 0; c < W; ++c) wrong += out[row * W + c] != s * 10000 + me * 100 + j * 10 + c;
    CHECK(wrong == 0);
    if (me == R - 1) CHECK(nr == 0);
  }
  SECTION("all_to_all_v at given rows: spans in reverse rank order, with gaps") {
    // Rank s sends 2 rows to rank d from row 3·(R−1−d) and receives rank s's at row 3·(R−1−s) + 1.
    const int W = 3;
    std::vector<int64_t> two(R, 2), send_at(R), recv_at(R);
    for (int r = 0; r < R; ++r) send_at[r] = 3 * (R - 1 - r), recv_at[r] = 3 * (R - 1 - r) + 1;
    std::vector<int32_t> in(size_t(3 * R * W), -7), out(size_t(3 * R * W), -1);
    for (int d = 0; d < R; ++d)
      for (int j = 0; j < 2; ++j)
        for (int c = 0; c < W; ++c) in[size_t((send_at[d] + j) * W + c)] = me * 10000 + d * 100 + j * 10 + c;
    Tensor tout(out.data(), DType::I32, {3 * R, W}), tin(in.data(), DType::I32, {3 * R, W});
    comm->all_to_all_v(tout, two, recv_at, tin, two, send_at);
    int wrong = 0;
    for (int64_t row = 0; row < 3 * R; ++row) {
      const int s = R - 1 - int(row / 3), j = int(row % 3) - 1;  // j = -1: the gap
      for (int c = 0; c < W; ++c)
        wrong += out[size_t(row * W + c)] != (j < 0 ? -1 : s * 10000 + me * 100 + j * 10 + c);
    }
    CHECK(wrong == 0);
    // Received spans that overlap, or reach past the buffer, are refused on every rank alike.
    std::vector<int64_t> same(R, 0), past(R, 3 * R - 1);
    CHECK_THROWS_AS(comm->all_to_all_v(tout, two, same, tin, two, send_at), Error);
    CHECK_THROWS_AS(comm->all_to_all_v(tout, two, past, tin, two, send_at), Error);
  }
  SECTION("send_recv around the ring, both directions") {
    for (int shift : {1, R - 1}) {
      const int dst = (me + shift) % R, src = (me - shift + R) % R;
      std::vector<int32_t> in(1001), out(1001, -1);
      for (int i = 0; i < 1001; ++i) in[i] = me * 100000 + shift * 10000 + i;
      comm->send_recv(Tensor(out.data(), DType::I32, {1001}), src, Tensor(in.data(), DType::I32, {1001}), dst);
      int wrong = 0;
      for (int i = 0; i < 1001; ++i) wrong += out[i] != src * 100000 + shift * 10000 + i;
      CHECK(wrong == 0);
    }
    std::vector<int32_t> a(4), b(5);
    CHECK_THROWS_AS(comm->send_recv(Tensor(b.data(), DType::I32, {5}), 0, Tensor(a.data(), DType::I32, {4}), 0),
                    Error);
  }
  SECTION("broadcast, host reductions, agreement") {
    std::vector<int64_t> x(3, me == 1 ? 42 : 0);
    comm->broadcast(Tensor(x.data(), DType::I64, {3}), 1);
    CHECK(x == std::vector<int64_t>{42, 42, 42});
    CHECK(comm->all_reduce_host(double(me), Comm::Op::Max) == R - 1);
    CHECK(comm->all_reduce_host(1.0, Comm::Op::Sum) == R);
    CHECK(comm->all_equal("same"));
    CHECK_FALSE(comm->all_equal(me == 0 ? "a" : "b"));
  }
}
