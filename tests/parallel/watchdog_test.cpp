// CollectiveWatchdog with an injected abort action: a collective that outlives a tiny timeout
// fires it once with the one-line message, fast and nested collectives and idle time do not, and
// watch() forwards every call of a Comm unchanged while bracketing it. The side channel: a
// rank's state round-trips, the line names the ranks that did not arrive, and on N MPI ranks a
// rank that is busy, or stopped with SIGSTOP, is the one named.
#include <mpi.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "parallel/mpi_comm.h"
#include "parallel/watchdog.h"

using namespace mop;
using namespace std::chrono_literals;

namespace {

// Records what the watchdog would have aborted with.
struct AbortRecorder {
  std::mutex mutex;
  std::vector<std::string> messages;
  std::function<void()> then;  // run after each message is recorded (on the watchdog thread)
  CollectiveWatchdog::AbortAction action() {
    return [this](const std::string& m) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        messages.push_back(m);
      }
      if (then) then();
    };
  }
  size_t count() {
    std::lock_guard<std::mutex> lock(mutex);
    return messages.size();
  }
  // Polls until `n` messages arrived or `limit` passed (a loaded CI machine may be slow to
  // schedule the watchdog thread; the test never waits longer than needed).
  bool wait_for(size_t n, std::chrono::milliseconds limit) {
    auto deadline = std::chrono::steady_clock::now() + limit;
    while (count() < n && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(1ms);
    return count() >= n;
  }
};

}  // namespace

TEST_CASE("watchdog: a collective past its timeout fires the abort action once",
          "[cpu][parallel]") {
  AbortRecorder rec;
  CollectiveWatchdog dog(0.02, rec.action());
  {
    ScopedCollective slow(dog, "fake all_to_all_v");
    CHECK(dog.in_flight());
    REQUIRE(rec.wait_for(1, 10000ms));
    // Still the same stuck collective: no second message.
    std::this_thread::sleep_for(100ms);
  }
  CHECK_FALSE(dog.in_flight());
  REQUIRE(rec.count() == 1);
  const std::string& m = rec.messages[0];
  INFO(m);
  CHECK(m.rfind("error: collective fake all_to_all_v (#1) on rank 0 (host ", 0) == 0);
  CHECK(m.find(") did not finish within 0.02 s; a peer rank failed or hung?; aborting the job") !=
        std::string::npos);
  CHECK(m.find('\n') == std::string::npos);

  // A later stuck collective fires again.
  dog.begin("second");
  REQUIRE(rec.wait_for(2, 10000ms));
  dog.end();
  CHECK(rec.messages[1].find("collective second (#2) on rank") != std::string::npos);
}

TEST_CASE("watchdog: fast, nested and absent collectives do not fire", "[cpu][parallel]") {
  AbortRecorder rec;
  // Long enough that scheduling noise between begin() and end() cannot reach it.
  CollectiveWatchdog dog(0.25, rec.action());
  for (int i = 0; i < 10000; ++i) {
    ScopedCollective outer(dog, "outer");
    ScopedCollective inner(dog, "inner");
  }
  CHECK(dog.num_collectives() == 10000);  // nested brackets count once
  CHECK_FALSE(dog.in_flight());
  std::this_thread::sleep_for(600ms);  // idle for more than two timeouts
  CHECK(rec.count() == 0);

  // A collective that throws still ends its bracket.
  try {
    ScopedCollective throwing(dog, "throws");
    throw std::runtime_error("peer error");
  } catch (const std::runtime_error&) {
  }
  CHECK_FALSE(dog.in_flight());
}

TEST_CASE("watchdog: a disabled watchdog still brackets", "[cpu][parallel]") {
  AbortRecorder rec;
  CollectiveWatchdog dog(0, rec.action());
  dog.begin("x");
  CHECK(dog.in_flight());
  std::this_thread::sleep_for(20ms);
  dog.end();
  CHECK(rec.count() == 0);
  CHECK(dog.timeout_s() == 0);
}

TEST_CASE("watchdog: watch() forwards every collective and brackets it", "[cpu][parallel]") {
  AbortRecorder rec;
  CollectiveWatchdog dog(kDefaultCollectiveTimeoutS, rec.action());
  auto comm = watch(make_self_comm(), dog);
  CHECK(comm->name() == "self");
  CHECK(comm->rank() == 0);
  CHECK(comm->size() == 1);

  std::vector<float> x = {1, 2, 3};
  comm->all_reduce_sum(Tensor(x.data(), DType::F32, {3}));
  CHECK(x == std::vector<float>{1, 2, 3});

  std::vector<int32_t> in = {4, 5, 6}, out(3, -1);
  comm->all_gather(Tensor(out.data(), DType::I32, {3}), Tensor(in.data(), DType::I32, {3}));
  CHECK(out == in);
  std::fill(out.begin(), out.end(), -1);
  comm->reduce_scatter_sum(Tensor(out.data(), DType::I32, {3}), Tensor(in.data(), DType::I32, {3}));
  CHECK(out == in);

  std::vector<int64_t> rows = {10, 11, 20, 21, 30, 31}, moved(8, -1);
  comm->all_to_all_v(Tensor(moved.data(), DType::I64, {4, 2}), {3},
                     Tensor(rows.data(), DType::I64, {3, 2}), {3});
  CHECK(moved == std::vector<int64_t>{10, 11, 20, 21, 30, 31, -1, -1});

  std::vector<int64_t> shifted(6, -1);
  comm->send_recv(Tensor(shifted.data(), DType::I64, {3, 2}), 0, Tensor(rows.data(), DType::I64, {3, 2}), 0);
  CHECK(shifted == rows);
  comm->broadcast(Tensor(x.data(), DType::F32, {3}), 0);
  comm->barrier();
  double v[2] = {1.5, -2};
  comm->all_reduce_host(v, 2, Comm::Op::Max);
  CHECK((v[0] == 1.5 && v[1] == -2));
  CHECK(comm->all_reduce_host(7.0, Comm::Op::Sum) == 7.0);
  CHECK(comm->all_equal("config"));
  // Seven device-style collectives, two host reductions and the one inside all_equal.
  CHECK(dog.num_collectives() == 10);
  CHECK_FALSE(dog.in_flight());

  // The inner Comm's errors come through, and the bracket ends.
  CHECK_THROWS_AS(comm->broadcast(Tensor(x.data(), DType::F32, {3}), 1), Error);
  CHECK_FALSE(dog.in_flight());
  CHECK(rec.count() == 0);
}

TEST_CASE("watchdog: its state as a peer sees it, and the line through the side channel",
          "[cpu][parallel]") {
  CollectiveWatchdog dog(0);
  WatchdogState s = dog.state();
  CHECK(s.seq == 0);
  CHECK_FALSE(s.in_flight);
  CHECK(s.what.empty());
  dog.begin("mpi barrier");
  std::this_thread::sleep_for(20ms);
  s = dog.state();
  CHECK((s.seq == 1 && s.in_flight && s.what == "mpi barrier" && s.age_s >= 0.015));
  dog.end();
  s = dog.state();
  CHECK((s.seq == 1 && !s.in_flight && s.what == "mpi barrier" && s.age_s < 1));

  WatchdogState a{412, true, 12.345, "nccl all_to_all_v"};
  auto b = decode_watchdog_state(encode_watchdog_state(a));
  REQUIRE(b);
  CHECK((b->seq == 412 && b->in_flight && b->what == "nccl all_to_all_v"));
  CHECK(b->age_s == Approx(12.345).margin(1e-3));
  CHECK_FALSE(decode_watchdog_state(""));
  CHECK_FALSE(decode_watchdog_state("12 3 5 x\n"));
  CHECK_FALSE(decode_watchdog_state("garbage"));
}

TEST_CASE("watchdog: the error line names the ranks that did not arrive", "[cpu][parallel]") {
  std::vector<PeerEndpoint> peers(4);
  for (int r = 0; r < 4; ++r) peers[size_t(r)].host = "node" + std::to_string(r / 2), peers[size_t(r)].pid = 100 + r;
  using S = std::optional<WatchdogState>;
  // Rank 0 waits in collective #7. Rank 1 waits there too, rank 3 is past it.
  std::vector<S> states = {S{}, WatchdogState{7, true, 3, "mpi barrier"}, S{},
                           WatchdogState{8, true, 1, "mpi all_reduce_host"}};
  CHECK(describe_stragglers(0, 7, peers, states) ==
        "rank 2 (host node1, pid 102) did not arrive: it does not answer (stopped, stuck in the "
        "kernel, or its node is down)");
  states[2] = WatchdogState{6, false, 4.31, "mpi barrier"};
  CHECK(describe_stragglers(0, 7, peers, states) ==
        "rank 2 (host node1, pid 102) did not arrive: it has been outside collectives for 4.3 s, "
        "since mpi barrier (#6) ended");
  states[3] = WatchdogState{5, true, 61, "nccl all_to_all_v"};
  CHECK(describe_stragglers(0, 7, peers, states) ==
        "rank 2 (host node1, pid 102) did not arrive: it has been outside collectives for 4.3 s, "
        "since mpi barrier (#6) ended; behind it, still in an earlier collective: rank 3 (host "
        "node1, pid 103) has been in collective nccl all_to_all_v (#5) for 61 s");
  // Only ranks inside earlier collectives: they are the ones named.
  CHECK(describe_stragglers(0, 7, peers, {S{}, states[3], WatchdogState{7, true, 1, "a"}, states[3]}) ==
        "ranks 1, 3 did not arrive: rank 1 (host node0, pid 101) has been in collective "
        "nccl all_to_all_v (#5) for 61 s; rank 3 (host node1, pid 103) has been in collective "
        "nccl all_to_all_v (#5) for 61 s");
  // The CI case on 3 ranks: rank 2 is at #9, rank 0 still in #8 waiting for rank 1, which is
  // stopped. Rank 1 is named first, as the one that did not arrive.
  CHECK(describe_stragglers(2, 9, peers, {WatchdogState{8, true, 4.4, "mpi all_reduce_sum"}, S{}, S{}}) ==
        "rank 1 (host node0, pid 101) did not arrive: it does not answer (stopped, stuck in the "
        "kernel, or its node is down); behind it, still in an earlier collective: rank 0 (host "
        "node0, pid 100) has been in collective mpi all_reduce_sum (#8) for 4.4 s");
  // Seen from rank 2 (its own entry ignored): everyone else answered at or past #7... but rank 3.
  CHECK(describe_stragglers(2, 7, peers, {S{}, states[1], S{}, WatchdogState{7, false, 0, "x"}}) ==
        "rank 0 (host node0, pid 100) did not arrive: it does not answer (stopped, stuck in the "
        "kernel, or its node is down)");
  CHECK(describe_stragglers(1, 7, peers, {WatchdogState{7, true, 1, "a"}, S{}, WatchdogState{9, false, 0, "b"},
                                          WatchdogState{7, true, 1, "a"}}) ==
        "every rank reached this collective (a stall in the network or on a device?)");
  CHECK(describe_stragglers(1, 3, peers, {WatchdogState{0, false, 2, ""}, S{}, S{}, S{}}).find(
            "ranks 0, 2, 3 did not arrive: rank 0 (host node0, pid 100) has begun no collective in "
            "2.0 s; rank 2") == 0);
  CHECK(describe_stragglers(0, 3, peers, {S{}, S{}, S{}, S{}}).find(
            "(no rank answered: is TCP between the ranks blocked?)") != std::string::npos);
  // Many stragglers: eight described, the rest counted.
  std::vector<PeerEndpoint> many(12, PeerEndpoint{"h", 1, 0, {}});
  std::string line = describe_stragglers(0, 1, many, std::vector<S>(12));
  CHECK(line.rfind("ranks 1, 2, 3, 4, 5, 6, 7, 8 and 3 more did not arrive: ", 0) == 0);
}

TEST_CASE("watchdog on N ranks names the rank that did not arrive, busy or stopped", "[mpi]") {
  int R = 1, me = 0;
  MPI_Comm_size(MPI_COMM_WORLD, &R);
  MPI_Comm_rank(MPI_COMM_WORLD, &me);
  REQUIRE(R >= 2);
  const int late = R - 1;
  AbortRecorder rec;
  CollectiveWatchdog dog(0.3, rec.action());
  dog.share_with_peers(1.0);
  auto comm = watch(make_mpi_comm(MPI_COMM_WORLD), dog);
  comm->barrier();  // #1 everywhere

  // The last rank computes (sleeps) for a while before it joins barrier #2.
  if (me == late) std::this_thread::sleep_for(3000ms);
  comm->barrier();
  if (me != late) {
    REQUIRE(rec.count() == 1);
    const std::string& m = rec.messages[0];
    INFO(m);
    CHECK(m.rfind("error: collective mpi barrier (#2) on rank " + std::to_string(me), 0) == 0);
    CHECK(m.find("; rank " + std::to_string(late) + " (host ") != std::string::npos);
    CHECK(m.find(", pid ") != std::string::npos);
    CHECK(m.find(") did not arrive: it has been outside collectives for ") != std::string::npos);
    CHECK(m.find("since mpi barrier (#1) ended; aborting the job") != std::string::npos);
  } else {
    CHECK(rec.count() == 0);
  }

  // The last rank stops itself (SIGSTOP) before barrier #3: its kernel still accepts the
  // watchdogs' connections but nobody answers. Rank 0 wakes it once its own line is written.
  REQUIRE(dog.peers());
  const pid_t late_pid = pid_t(dog.peers()->endpoints()[size_t(late)].pid);
  if (me == 0) rec.then = [late_pid] { kill(late_pid, SIGCONT); };
  comm->barrier();  // #3
  const size_t before = rec.count();
  if (me == late) raise(SIGSTOP);
  comm->barrier();  // #4
  if (me == 0) {
    REQUIRE(rec.count() == before + 1);
    const std::string& m = rec.messages[before];
    INFO(m);
    CHECK(m.rfind("error: collective mpi barrier (#4) on rank 0", 0) == 0);
    CHECK(m.find("rank " + std::to_string(late) + " (host ") != std::string::npos);
    CHECK(m.find(") did not arrive: it does not answer (stopped,") != std::string::npos);
  }
  comm->barrier();
}
