// CollectiveWatchdog: a background thread that ends the whole job when a collective does not
// finish within a timeout (a peer rank died or hung), with one line naming the collective, the
// rank and the host, and — once share_with_peers() has run — the ranks that did not arrive and
// what each was doing, instead of every rank waiting forever. ScopedCollective brackets one
// collective; watch() wraps a Comm so that every collective it runs is bracketed.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>

#include "parallel/watchdog_peers.h"
#include "runtime/comm.h"

namespace mop {

// Ten minutes: far above any healthy collective (a slow all-to-all of a large step takes
// seconds), short enough that a hung job frees its nodes soon.
constexpr double kDefaultCollectiveTimeoutS = 600;

class CollectiveWatchdog {
 public:
  // Called on the watchdog thread with the one-line message (no trailing newline). The default
  // prints it on stderr and ends the job: MPI_Abort(MPI_COMM_WORLD, 1) under MPI, else _Exit(1).
  // Tests inject their own; when it returns, the watchdog goes on watching (it fires once per
  // collective).
  using AbortAction = std::function<void(const std::string& message)>;

  // timeout_s ≤ 0 disables the thread (begin/end stay valid and cheap). Rank and host for the
  // message are read here: construct it after MPI is initialised.
  explicit CollectiveWatchdog(double timeout_s = kDefaultCollectiveTimeoutS,
                              AbortAction on_timeout = nullptr);
  ~CollectiveWatchdog();
  CollectiveWatchdog(const CollectiveWatchdog&) = delete;
  CollectiveWatchdog& operator=(const CollectiveWatchdog&) = delete;

  // Bracket one collective. Lock-free (a clock read and a few atomics). Brackets nest; the
  // outermost one is timed and named. One thread brackets at a time (the thread that issues the
  // collectives). `what` must stay valid until the watchdog is destroyed: a string literal or a
  // string from intern().
  void begin(const char* what);
  void end();

  // Keeps `name` alive as long as the watchdog and returns a pointer for begin() (not for the hot
  // path: it takes a lock and allocates).
  const char* intern(std::string name);

  double timeout_s() const { return timeout_s_; }
  bool in_flight() const { return depth_.load(std::memory_order_acquire) > 0; }
  uint64_t num_collectives() const { return seq_.load(std::memory_order_relaxed); }

  // Collective over MPI_COMM_WORLD, from the thread that runs MPI: opens the side channel over
  // which a firing watchdog asks every peer for its state (WatchdogPeers), waiting at most
  // query_s for the answers. Call it before the first collective is bracketed.
  void share_with_peers(double query_s = 2.0);

  const WatchdogPeers* peers() const { return peers_.get(); }  // null before share_with_peers

  // This rank's state as a peer's query sees it.
  WatchdogState state() const;

  static void default_abort(const std::string& message);

 private:
  void run();
  std::string message(const char* what, uint64_t seq) const;

  double timeout_s_;
  AbortAction on_timeout_;
  int rank_ = 0;
  std::string host_;

  // Written by begin/end, read by the watcher thread. start_ns_ == 0: nothing in flight.
  std::atomic<int> depth_{0};
  std::atomic<uint64_t> seq_{0};
  std::atomic<int64_t> start_ns_{0};
  std::atomic<const char*> what_{nullptr};  // the in-flight collective, or the last one
  std::atomic<int64_t> last_end_ns_{0};      // when the last one ended (construction before any)
  std::unique_ptr<WatchdogPeers> peers_;
  double query_s_ = 2.0;

  std::mutex mutex_;  // stop_ and interned_ only; never taken by begin/end
  std::condition_variable wake_;
  bool stop_ = false;
  std::deque<std::string> interned_;  // a deque keeps element addresses on push_back
  std::thread thread_;
};

// Brackets a collective for its scope, also when it throws.
class ScopedCollective {
 public:
  ScopedCollective(CollectiveWatchdog& dog, const char* what) : dog_(dog) { dog_.begin(what); }
  ~ScopedCollective() { dog_.end(); }
  ScopedCollective(const ScopedCollective&) = delete;
  ScopedCollective& operator=(const ScopedCollective&) = delete;

 private:
  CollectiveWatchdog& dog_;
};

// A Comm that forwards every call to `inner`, each collective bracketed on `dog` and named
// "<inner name> <collective>" (e.g. "nccl all_to_all_v"). `dog` must outlive the result.
// Device collectives (NCCL) return once enqueued, so a hang there shows at the next stream sync
// or barrier: bracket those syncs too (ScopedCollective) to watch the device side.
std::unique_ptr<Comm> watch(std::unique_ptr<Comm> inner, CollectiveWatchdog& dog);

}  // namespace mop
