// The collective checks every Comm of host tensors passes, run over MPI ranks and over in-process
// ranks (comm_test.cpp): payloads encode the source rank and element index, so each collective is
// checked exactly. In-process ranks are threads and Catch2's assertions are not thread-safe, so
// every check goes through RANK_CHECK (one at a time), and no collective runs inside one (a rank
// holding the lock while it waits for the others would stop them at their next check).
#pragma once

#include <algorithm>
#include <mutex>
#include <vector>

#include "catch.h"
#include "core/error.h"
#include "runtime/comm.h"

namespace mop::test {

inline std::mutex& rank_check_mutex() {
  static std::mutex m;
  return m;
}

#define RANK_CHECK(...)                                                          \
  do {                                                                           \
    std::lock_guard<std::mutex> rank_check_lock_(mop::test::rank_check_mutex()); \
    CHECK(__VA_ARGS__);                                                          \
  } while (0)

// True when fn() throws a mop::Error (run outside RANK_CHECK, then checked).
template <class Fn>
bool throws_error(Fn&& fn) {
  try {
    fn();
  } catch (const Error&) {
    return true;
  }
  return false;
}

inline void check_all_reduce_sum(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  std::vector<double> x(1000);
  for (int i = 0; i < 1000; ++i) x[i] = me * 1000 + i;
  comm.all_reduce_sum(Tensor(x.data(), DType::F64, {1000}));
  int wrong = 0;
  for (int i = 0; i < 1000; ++i) wrong += x[i] != double(R * i + 1000 * (R * (R - 1) / 2));
  RANK_CHECK(wrong == 0);
}

inline void check_all_gather_and_reduce_scatter(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  std::vector<int32_t> in(5), out(5 * R);
  for (int i = 0; i < 5; ++i) in[i] = me * 100 + i;
  comm.all_gather(Tensor(out.data(), DType::I32, {5 * R}), Tensor(in.data(), DType::I32, {5}));
  int wrong = 0;
  for (int r = 0; r < R; ++r)
    for (int i = 0; i < 5; ++i) wrong += out[r * 5 + i] != r * 100 + i;
  RANK_CHECK(wrong == 0);
  std::vector<float> full(3 * R), part(3);
  for (int i = 0; i < 3 * R; ++i) full[i] = float(me + i);
  comm.reduce_scatter_sum(Tensor(part.data(), DType::F32, {3}),
                          Tensor(full.data(), DType::F32, {3 * R}));
  for (int i = 0; i < 3; ++i) RANK_CHECK(part[i] == float(R * (me * 3 + i) + R * (R - 1) / 2));
}

inline void check_all_to_all_v_counts(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
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
  comm.all_to_all_v(Tensor(out.data(), DType::I32, {std::max<int64_t>(nr, 1), W}), recv,
                    Tensor(in.data(), DType::I32, {std::max<int64_t>(ns, 1), W}), send);
  int wrong = 0;
  row = 0;
  for (int s = 0; s < R; ++s)
    for (int j = 0; j < recv[s]; ++j, ++row)
      for (int c = 0; c < W; ++c) wrong += out[row * W + c] != s * 10000 + me * 100 + j * 10 + c;
  RANK_CHECK(wrong == 0);
  if (me == R - 1) RANK_CHECK(nr == 0);
}

inline void check_all_to_all_v_offsets(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  // Rank s sends 2 rows to rank d from row 3·(R−1−d) and receives rank s's at row 3·(R−1−s) + 1.
  const int W = 3;
  std::vector<int64_t> two(R, 2), send_at(R), recv_at(R);
  for (int r = 0; r < R; ++r) send_at[r] = 3 * (R - 1 - r), recv_at[r] = 3 * (R - 1 - r) + 1;
  std::vector<int32_t> in(size_t(3 * R * W), -7), out(size_t(3 * R * W), -1);
  for (int d = 0; d < R; ++d)
    for (int j = 0; j < 2; ++j)
      for (int c = 0; c < W; ++c)
        in[size_t((send_at[d] + j) * W + c)] = me * 10000 + d * 100 + j * 10 + c;
  Tensor tout(out.data(), DType::I32, {3 * R, W}), tin(in.data(), DType::I32, {3 * R, W});
  comm.all_to_all_v(tout, two, recv_at, tin, two, send_at);
  int wrong = 0;
  for (int64_t row = 0; row < 3 * R; ++row) {
    const int s = R - 1 - int(row / 3), j = int(row % 3) - 1;  // j = -1: the gap
    for (int c = 0; c < W; ++c)
      wrong += out[size_t(row * W + c)] != (j < 0 ? -1 : s * 10000 + me * 100 + j * 10 + c);
  }
  RANK_CHECK(wrong == 0);
  // Received spans that overlap, or reach past the buffer, are refused on every rank alike.
  std::vector<int64_t> same(R, 0), past(R, 3 * R - 1);
  const bool overlap_refused =
      throws_error([&] { comm.all_to_all_v(tout, two, same, tin, two, send_at); });
  const bool past_refused =
      throws_error([&] { comm.all_to_all_v(tout, two, past, tin, two, send_at); });
  RANK_CHECK(overlap_refused);
  RANK_CHECK(past_refused);
}

inline void check_send_recv(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  for (int shift : {1, R - 1}) {
    const int dst = (me + shift) % R, src = (me - shift + R) % R;
    std::vector<int32_t> in(1001), out(1001, -1);
    for (int i = 0; i < 1001; ++i) in[i] = me * 100000 + shift * 10000 + i;
    comm.send_recv(Tensor(out.data(), DType::I32, {1001}), src,
                   Tensor(in.data(), DType::I32, {1001}), dst);
    int wrong = 0;
    for (int i = 0; i < 1001; ++i) wrong += out[i] != src * 100000 + shift * 10000 + i;
    RANK_CHECK(wrong == 0);
  }
  std::vector<int32_t> a(4), b(5);
  const bool sizes_refused = throws_error([&] {
    comm.send_recv(Tensor(b.data(), DType::I32, {5}), 0, Tensor(a.data(), DType::I32, {4}), 0);
  });
  RANK_CHECK(sizes_refused);
}

inline void check_broadcast_host_reductions_agreement(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  std::vector<int64_t> x(3, me == 1 ? 42 : 0);
  comm.broadcast(Tensor(x.data(), DType::I64, {3}), 1);
  RANK_CHECK(x == std::vector<int64_t>{42, 42, 42});
  const double max = comm.all_reduce_host(double(me), Comm::Op::Max);
  const double sum = comm.all_reduce_host(1.0, Comm::Op::Sum);
  const bool same = comm.all_equal("same"), differ = !comm.all_equal(me == 0 ? "a" : "b");
  RANK_CHECK(max == R - 1);
  RANK_CHECK(sum == R);
  RANK_CHECK(same);
  RANK_CHECK(differ);
}

struct CollectiveCheck {
  const char* name;
  void (*run)(Comm& comm);
};

// Every check, for groups of at least 2 ranks.
inline const std::vector<CollectiveCheck>& collective_checks() {
  static const std::vector<CollectiveCheck> checks = {
      {"all_reduce_sum", check_all_reduce_sum},
      {"all_gather and reduce_scatter", check_all_gather_and_reduce_scatter},
      {"all_to_all_v with variable counts and a rank that receives nothing",
       check_all_to_all_v_counts},
      {"all_to_all_v at given rows: spans in reverse rank order, with gaps",
       check_all_to_all_v_offsets},
      {"send_recv around the ring, both directions", check_send_recv},
      {"broadcast, host reductions, agreement", check_broadcast_host_reductions_agreement},
  };
  return checks;
}

}  // namespace mop::test
