// CollectiveWatchdog with an injected abort action: a collective that outlives a tiny timeout
// fires it once with the one-line message, fast and nested collectives and idle time do not, and
// watch() forwards every call of a Comm unchanged while bracketing it.
#include <atomic>
#include <chrono>
#include <cstring>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "parallel/watchdog.h"

using namespace mop;
using namespace std::chrono_literals;

namespace {

// Records what the watchdog would have aborted with.
struct AbortRecorder {
  std::mutex mutex;
  std::vector<std::string> messages;
  CollectiveWatchdog::AbortAction action() {
    return [this](const std::string& m) {
      std::lock_guard<std::mutex> lock(mutex);
      messages.push_back(m);
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
  CHECK(m.rfind("error: collective fake all_to_all_v on rank 0 (host ", 0) == 0);
  CHECK(m.find(") did not finish within 0.02 s; aborting the job (a peer rank failed or hung?)") !=
        std::string::npos);
  CHECK(m.find('\n') == std::string::npos);

  // A later stuck collective fires again.
  dog.begin("second");
  REQUIRE(rec.wait_for(2, 10000ms));
  dog.end();
  CHECK(rec.messages[1].find("collective second on rank") != std::string::npos);
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
