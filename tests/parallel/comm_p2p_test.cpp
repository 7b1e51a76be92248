// Point-to-point messages between pipeline stages (Comm::send / Comm::recv) over in-process ranks
// (2, 3, 4) and MPI ranks (mpirun -np 2 and 4): a 1F1B-like exchange in which neighbours send to
// each other at once with several messages in flight, FIFO order per pair, bit-exact payloads of
// several dtypes and sizes (a zero-byte one and ones past MPI's eager limit included), send buffers
// reused at once, and the errors: a receive whose tag or size does not match the oldest message,
// and messages to or from the rank itself. Payload bytes encode (source, destination, message,
// byte index), so a message delivered to the wrong place or in the wrong order shows exactly.
#include <mpi.h>

#include <cstring>
#include <functional>
#include <string>
#include <vector>

#include "catch.h"
#include "ops/ops.h"
#include "ops/timed_ops.h"
#include "parallel/collective_checks.h"
#include "parallel/collective_log.h"
#include "parallel/inprocess_comm.h"
#include "parallel/mpi_comm.h"
#include "parallel/standin_comm.h"
#include "parallel/timed_comm.h"
#include "parallel/watchdog.h"

using namespace mop;
using namespace mop::test;

namespace {

// The byte `i` of message `msg` from rank `src` to rank `dst`: every bit of it depends on all four.
uint8_t payload_byte(int src, int dst, int msg, size_t i) {
  uint64_t x = (uint64_t(src) << 48) ^ (uint64_t(dst) << 40) ^ (uint64_t(msg) << 32) ^ uint64_t(i);
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return uint8_t(x ^ (x >> 31));
}

void fill(std::vector<char>& buf, int src, int dst, int msg) {
  for (size_t i = 0; i < buf.size(); ++i) buf[i] = char(payload_byte(src, dst, msg, i));
}

int64_t wrong_bytes(const std::vector<char>& buf, int src, int dst, int msg) {
  int64_t wrong = 0;
  for (size_t i = 0; i < buf.size(); ++i)
    wrong += uint8_t(buf[i]) != payload_byte(src, dst, msg, i);
  return wrong;
}

// Message `msg`'s tensor shape: the dtypes rotate, the sizes include 0 bytes, a prime and, every
// seventh message, 1.2 MB (past MPI's eager limit, so a send needs its receive to finish).
struct Shape {
  DType dtype;
  int64_t rows, cols;
  size_t bytes() const { return size_t(rows * cols) * dtype_size(dtype); }
};
Shape message_shape(int msg) {
  static const DType dtypes[] = {DType::F32, DType::BF16, DType::I64,
                                 DType::U8,  DType::F64,  DType::I32};
  const DType t = dtypes[msg % 6];
  if (msg % 7 == 6) return {t, 1201, 1000 / int64_t(dtype_size(t))};
  if (msg % 5 == 4) return {t, 0, 3};
  return {t, 1 + (msg * 13) % 17, 7};
}

Tensor view(std::vector<char>& buf, const Shape& s) {
  return Tensor(buf.data(), s.dtype, {s.rows, s.cols});
}

// Tags of a pipeline: activations of micro-batch mb go forward, their gradients back.
int act_tag(int mb) {
  return 2 * mb;
}
int grad_tag(int mb) {
  return 2 * mb + 1;
}

// Ranks are stages 0 … R-1. Each stage sends micro-batch mb's activation forward and a gradient
// back, both before receiving anything of that micro-batch, so both neighbours of every pair send
// to each other at once; receives trail the sends by `in_flight` micro-batches. One send buffer
// serves every message and is poisoned right after each send (a send must not need it later).
void check_pipeline_exchange(Comm& comm, int num_mb, int in_flight) {
  const int R = comm.size(), me = comm.rank();
  const bool has_next = me + 1 < R, has_prev = me > 0;
  int64_t wrong = 0;
  std::vector<char> buf;
  auto send = [&](int dst, int mb, int tag) {
    const Shape s = message_shape(mb);
    buf.assign(s.bytes(), 0);
    fill(buf, me, dst, mb);
    comm.send(view(buf, s), dst, tag);
    std::fill(buf.begin(), buf.end(), char(0x5a));
  };
  auto recv = [&](int src, int mb, int tag) {
    const Shape s = message_shape(mb);
    std::vector<char> got(s.bytes(), char(0xa5));
    comm.recv(view(got, s), src, tag);
    wrong += wrong_bytes(got, src, me, mb);
  };
  auto receive_mb = [&](int mb) {
    if (has_prev) recv(me - 1, mb, act_tag(mb));
    if (has_next) recv(me + 1, mb, grad_tag(mb));
  };
  for (int mb = 0; mb < num_mb; ++mb) {
    if (has_next) send(me + 1, mb, act_tag(mb));
    if (has_prev) send(me - 1, mb, grad_tag(mb));
    if (mb >= in_flight) receive_mb(mb - in_flight);
  }
  for (int mb = std::max(0, num_mb - in_flight); mb < num_mb; ++mb) receive_mb(mb);
  comm.join();
  RANK_CHECK(wrong == 0);
}

// FIFO per pair with one tag for all: only the order tells the messages apart. Rank 0 sends to
// every other rank, each of them sends back, and every pair has `n` messages in flight.
void check_fifo_same_tag(Comm& comm, int n) {
  const int R = comm.size(), me = comm.rank();
  const std::vector<int> peers = me == 0 ? [&] {
    std::vector<int> p;
    for (int r = 1; r < R; ++r) p.push_back(r);
    return p;
  }() : std::vector<int>{0};
  std::vector<char> buf(40);
  for (int k = 0; k < n; ++k)
    for (int peer : peers) {
      fill(buf, me, peer, k);
      comm.send(Tensor(buf.data(), DType::F32, {10}), peer, 9);
    }
  int64_t wrong = 0;
  for (int k = 0; k < n; ++k)
    for (int peer : peers) {
      std::vector<char> got(40, 0);
      comm.recv(Tensor(got.data(), DType::F32, {10}), peer, 9);
      wrong += wrong_bytes(got, peer, me, k);
    }
  RANK_CHECK(wrong == 0);
}

std::string error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

bool has(const std::string& s, const std::string& part) {
  return s.find(part) != std::string::npos;
}

// Rank 1 receives with the wrong tag, then the wrong size, from rank 0: each fails naming both
// messages, consumes the mismatched one, and the next message pairs up again. Every rank refuses
// to send to or receive from itself or a rank outside the group.
void check_message_errors(Comm& comm) {
  const int R = comm.size(), me = comm.rank();
  std::vector<float> x(16, float(me)), y(16, -1.f);
  const Tensor x16(x.data(), DType::F32, {16});
  if (me == 0) {
    comm.send(x16, 1, 5);
    comm.send(x16, 1, 7);
    comm.send(x16, 1, 8);
  } else if (me == 1) {
    const std::string tag_error =
        error_of([&] { comm.recv(Tensor(y.data(), DType::F32, {16}), 0, 6); });
    RANK_CHECK(has(tag_error, "expects tag 6, f32[16] (64 bytes)"));
    RANK_CHECK(has(tag_error, "oldest message from rank 0 is tag 5, f32[16] (64 bytes)"));
    const std::string size_error =
        error_of([&] { comm.recv(Tensor(y.data(), DType::F32, {8}), 0, 7); });
    RANK_CHECK(has(size_error, "expects tag 7, f32[8] (32 bytes)"));
    RANK_CHECK(has(size_error, "is tag 7, f32[16] (64 bytes)"));
    comm.recv(Tensor(y.data(), DType::F32, {16}), 0, 8);
    RANK_CHECK(y == std::vector<float>(16, 0.f));
  }
  const Tensor y16(y.data(), DType::F32, {16});
  for (int peer : {me, -1, R}) {
    const std::string s = error_of([&] { comm.send(x16, peer, 0); });
    const std::string r = error_of([&] { comm.recv(y16, peer, 0); });
    RANK_CHECK(has(s, "send on rank " + std::to_string(me) + ": peer " + std::to_string(peer)));
    RANK_CHECK(has(r, "recv on rank " + std::to_string(me) + ": peer " + std::to_string(peer)));
  }
  comm.barrier();
}

struct P2pCheck {
  const char* name;
  std::function<void(Comm&)> run;
};

const std::vector<P2pCheck>& p2p_checks() {
  static const std::vector<P2pCheck> checks = {
      {"pipeline exchange, 1 micro-batch in flight",
       [](Comm& c) { check_pipeline_exchange(c, 12, 1); }},
      {"pipeline exchange, 4 in flight", [](Comm& c) { check_pipeline_exchange(c, 12, 4); }},
      {"pipeline exchange, every send before any receive",
       [](Comm& c) { check_pipeline_exchange(c, 3, 8); }},
      {"FIFO per pair under one tag", [](Comm& c) { check_fifo_same_tag(c, 6); }},
      {"mismatched tag or size, self and outside peers", check_message_errors},
  };
  return checks;
}

}  // namespace

TEST_CASE("comm p2p: in-process ranks exchange a pipeline's messages exactly", "[cpu][comm][p2p]") {
  for (const P2pCheck& check : p2p_checks())
    for (int R : {2, 3, 4}) {
      INFO(check.name << ", " << R << " in-process ranks");
      std::vector<std::unique_ptr<Comm>> comms = make_inprocess_comms(R);
      CHECK_NOTHROW(run_inprocess(R, [&](int rank) { check.run(*comms[size_t(rank)]); }));
    }
}

TEST_CASE("comm p2p: MPI ranks exchange a pipeline's messages exactly", "[mpi][comm][p2p]") {
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  REQUIRE(comm->size() >= 2);
  for (const P2pCheck& check : p2p_checks()) SECTION(check.name) check.run(*comm);
}

TEST_CASE("comm p2p: MPI comms of one communicator keep their messages apart by channel",
          "[mpi][comm][p2p]") {
  auto a = make_mpi_comm(MPI_COMM_WORLD, 1), b = make_mpi_comm(MPI_COMM_WORLD, 2);
  const int R = a->size(), me = a->rank(), next = (me + 1) % R, prev = (me + R - 1) % R;
  std::vector<char> sa(24), sb(24), ra(24), rb(24);
  fill(sa, me, next, 1), fill(sb, me, next, 2);
  a->send(Tensor(sa.data(), DType::U8, {24}), next, 3);
  b->send(Tensor(sb.data(), DType::U8, {24}), next, 4);
  // Received in the other order than sent: each comm sees only its own.
  b->recv(Tensor(rb.data(), DType::U8, {24}), prev, 4);
  a->recv(Tensor(ra.data(), DType::U8, {24}), prev, 3);
  CHECK(wrong_bytes(ra, prev, me, 1) == 0);
  CHECK(wrong_bytes(rb, prev, me, 2) == 0);
  a->barrier();
}

TEST_CASE("comm p2p: a group of one and stand-ins refuse themselves as peers", "[cpu][comm][p2p]") {
  std::vector<float> x(4, 1.f);
  const Tensor t(x.data(), DType::F32, {4});
  auto self = make_self_comm();
  CHECK(has(error_of([&] { self->send(t, 0, 0); }), "peer 0 is not another rank"));
  CHECK(has(error_of([&] { self->recv(t, 0, 0); }), "peer 0 is not another rank"));

  // A stand-in's peers exist only on paper: sends go nowhere, a receive leaves `out` as it was.
  auto job = std::make_shared<StandInJob>();
  job->rank = 1, job->size = 4;
  auto standin = make_standin_comm_factory(job)->host(world_group(4, 1));
  standin->send(t, 2, 0);
  standin->recv(t, 0, 1);
  CHECK(x == std::vector<float>(4, 1.f));
  CHECK(has(error_of([&] { standin->send(t, 1, 0); }), "peer 1 is not another rank"));
  CHECK(has(error_of([&] { standin->recv(t, 4, 0); }), "peer 4 is not another rank"));
}

TEST_CASE("comm p2p: the timed, watched and recording wrappers forward messages",
          "[cpu][comm][p2p]") {
  auto world = make_inprocess_world(2);
  CollectiveLog log0, log1;
  CollectiveWatchdog dog(0);  // disabled: brackets only
  std::vector<std::unique_ptr<Comm>> comms;
  comms.push_back(watch(
      record_collectives(make_inprocess_comm_factory(world, 0), log0)->host(world_group(2, 0)),
      dog));
  TimedOps timed(make_cpu_ops());
  comms.push_back(time_comm(
      record_collectives(make_inprocess_comm_factory(world, 1), log1)->host(world_group(2, 1)),
      timed, "p2p"));
  timed.start_trace();
  run_inprocess(2, [&](int rank) { check_pipeline_exchange(*comms[size_t(rank)], 4, 2); });
  std::vector<std::string> names;
  for (const TraceEvent& e : timed.stop_trace()) names.push_back(e.name);
  CHECK(names == std::vector<std::string>{"send", "send", "send", "recv", "send", "recv", "recv",
                                          "recv", "join p2p"});
  REQUIRE(log0.entries().size() == 8);
  CHECK(log0.entries()[0] == "host world(2) send f32[1,7] to 1 tag 0");
  CHECK(log0.entries()[3] == "host world(2) recv f32[1,7] from 1 tag 1");
  CHECK(log1.entries()[0] == "host world(2) send f32[1,7] to 0 tag 1");
  CHECK(dog.num_collectives() == 8);
}
