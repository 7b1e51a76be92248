// The watchdog thread polls the in-flight collective's start time (a few wake-ups per timeout,
// at most one a second) and fires once per collective that outlives the timeout. WatchedComm
// forwards to the wrapped Comm inside a ScopedCollective.
#include "parallel/watchdog.h"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sstream>

namespace mop {
namespace {

int64_t now_ns() {
  auto t = std::chrono::steady_clock::now().time_since_epoch();
  // 0 marks "nothing in flight"; the steady clock never reads 0 after boot, but be exact anyway.
  return std::max<int64_t>(1, std::chrono::duration_cast<std::chrono::nanoseconds>(t).count());
}

bool mpi_active() {
  // Both may be called from any thread, before MPI_Init and after MPI_Finalize.
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  return initialized && !finalized;
}

}  // namespace

CollectiveWatchdog::CollectiveWatchdog(double timeout_s, AbortAction on_timeout)
    : timeout_s_(timeout_s), on_timeout_(on_timeout ? std::move(on_timeout) : default_abort) {
  if (mpi_active()) MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  host_ = host;
  last_end_ns_.store(now_ns(), std::memory_order_relaxed);
  if (timeout_s_ > 0) thread_ = std::thread([this] { run(); });
}

CollectiveWatchdog::~CollectiveWatchdog() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    stop_ = true;
  }
  wake_.notify_all();
  if (thread_.joinable()) thread_.join();
  peers_.reset();  // its thread reads what_, which may point into interned_
}

void CollectiveWatchdog::share_with_peers(double query_s) {
  query_s_ = query_s;
  // Kept when its probe failed: this rank still answers the peers that can reach it.
  peers_ = std::make_unique<WatchdogPeers>([this] { return state(); });
}

WatchdogState CollectiveWatchdog::state() const {
  WatchdogState s;
  // Read the start first: a collective that begins meanwhile shows as the one before it ending.
  const int64_t start = start_ns_.load(std::memory_order_acquire);
  s.seq = seq_.load(std::memory_order_acquire);
  const char* what = what_.load(std::memory_order_acquire);
  s.what = what ? what : "";
  s.in_flight = start != 0;
  const int64_t since = s.in_flight ? start : last_end_ns_.load(std::memory_order_acquire);
  s.age_s = double(std::max<int64_t>(0, now_ns() - since)) * 1e-9;
  if (s.in_flight) return s;
  // Not in flight: a begin() racing with this read may have counted its number already.
  if (start_ns_.load(std::memory_order_acquire) != 0 && s.seq > 0) --s.seq;
  return s;
}

void CollectiveWatchdog::begin(const char* what) {
  if (depth_.fetch_add(1, std::memory_order_acq_rel) != 0)
    return;  // nested: the outer one is timed
  what_.store(what, std::memory_order_relaxed);
  seq_.fetch_add(1, std::memory_order_relaxed);
  // Published last, with release: a watcher that sees this start also sees its name and number.
  start_ns_.store(now_ns(), std::memory_order_release);
}

void CollectiveWatchdog::end() {
  if (depth_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
    last_end_ns_.store(now_ns(), std::memory_order_relaxed);
    start_ns_.store(0, std::memory_order_release);
  }
}

const char* CollectiveWatchdog::intern(std::string name) {
  std::lock_guard<std::mutex> lock(mutex_);
  return interned_.emplace_back(std::move(name)).c_str();
}

std::string CollectiveWatchdog::message(const char* what, uint64_t seq) const {
  std::ostringstream os;
  os << "error: collective " << (what ? what : "?") << " (#" << seq << ") on rank " << rank_
     << " (host " << host_ << ") did not finish within " << timeout_s_ << " s; ";
  if (peers_ && peers_->error().empty())
    os << describe_stragglers(peers_->rank(), seq, peers_->endpoints(), peers_->query(query_s_));
  else
    os << "a peer rank failed or hung?";
  os << "; aborting the job";
  return os.str();
}

void CollectiveWatchdog::run() {
  const auto timeout = std::chrono::duration<double>(timeout_s_);
  const int64_t timeout_ns = std::chrono::duration_cast<std::chrono::nanoseconds>(timeout).count();
  // Detection lags the deadline by at most one period: 1/8 of the timeout, within [1 ms, 1 s].
  const auto period = std::clamp(std::chrono::duration_cast<std::chrono::nanoseconds>(timeout / 8),
                                 std::chrono::nanoseconds(std::chrono::milliseconds(1)),
                                 std::chrono::nanoseconds(std::chrono::seconds(1)));
  uint64_t fired_seq = 0;  // collectives are numbered from 1
  std::unique_lock<std::mutex> lock(mutex_);
  while (!wake_.wait_for(lock, period, [this] { return stop_; })) {
    int64_t start = start_ns_.load(std::memory_order_acquire);
    if (start == 0) continue;
    uint64_t seq = seq_.load(std::memory_order_acquire);
    if (seq == fired_seq || now_ns() - start < timeout_ns) continue;
    const char* what = what_.load(std::memory_order_acquire);
    // Still the same collective (not one that ended and another that began meanwhile)?
    if (start_ns_.load(std::memory_order_acquire) != start ||
        seq_.load(std::memory_order_acquire) != seq)
      continue;
    fired_seq = seq;
    lock.unlock();  // asking the peers and the action take long (MPI_Abort); intern() locks
    std::string line = message(what, seq);
    on_timeout_(line);
    lock.lock();
  }
}

void CollectiveWatchdog::default_abort(const std::string& message) {
  std::fprintf(stderr, "%s\n", message.c_str());
  std::fflush(stderr);
  // MPI_Abort from this thread although MPI was initialised FUNNELED: it is the one call meant to
  // work from a broken state, and Open MPI's kills the job from any thread. Without MPI, _Exit
  // rather than exit: the stuck thread still uses what static destructors would tear down.
  if (mpi_active()) MPI_Abort(MPI_COMM_WORLD, 1);
  std::_Exit(1);
}

namespace {

class WatchedComm final : public Comm {
 public:
  WatchedComm(std::unique_ptr<Comm> inner, CollectiveWatchdog& dog)
      : inner_(std::move(inner)), dog_(dog) {
    std::string prefix = inner_->name() + " ";
    all_reduce_ = dog_.intern(prefix + "all_reduce_sum");
    all_gather_ = dog_.intern(prefix + "all_gather");
    reduce_scatter_ = dog_.intern(prefix + "reduce_scatter_sum");
    all_to_all_ = dog_.intern(prefix + "all_to_all_v");
    send_recv_ = dog_.intern(prefix + "send_recv");
    send_ = dog_.intern(prefix + "send");
    recv_ = dog_.intern(prefix + "recv");
    broadcast_ = dog_.intern(prefix + "broadcast");
    barrier_ = dog_.intern(prefix + "barrier");
    host_reduce_ = dog_.intern(prefix + "all_reduce_host");
  }

  int rank() const override { return inner_->rank(); }
  int size() const override { return inner_->size(); }
  std::string name() const override { return inner_->name(); }

  void all_reduce_sum(Tensor x) override {
    ScopedCollective watched(dog_, all_reduce_);
    inner_->all_reduce_sum(x);
  }
  void all_gather(Tensor out, const Tensor& in) override {
    ScopedCollective watched(dog_, all_gather_);
    inner_->all_gather(out, in);
  }
  void all_gather_expert_counts(Tensor out, const Tensor& in, int moe_layer) override {
    ScopedCollective watched(dog_, all_gather_);
    inner_->all_gather_expert_counts(out, in, moe_layer);
  }
  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    ScopedCollective watched(dog_, reduce_scatter_);
    inner_->reduce_scatter_sum(out, in);
  }
  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    ScopedCollective watched(dog_, all_to_all_);
    inner_->all_to_all_v(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    ScopedCollective watched(dog_, send_recv_);
    inner_->send_recv(out, src, in, dst);
  }
  void send(const Tensor& in, int dst, int tag) override {
    ScopedCollective watched(dog_, send_);
    inner_->send(in, dst, tag);
  }
  // A receive whose message never comes (a peer died, or the schedule lost a send) fires here.
  void recv(Tensor out, int src, int tag) override {
    ScopedCollective watched(dog_, recv_);
    inner_->recv(out, src, tag);
  }
  void broadcast(Tensor x, int root) override {
    ScopedCollective watched(dog_, broadcast_);
    inner_->broadcast(x, root);
  }
  void join() override { inner_->join(); }  // a stream wait: returns at once
  void barrier() override {
    ScopedCollective watched(dog_, barrier_);
    inner_->barrier();
  }
  using Comm::all_reduce_host;
  void all_reduce_host(double* values, int n, Op op) override {
    ScopedCollective watched(dog_, host_reduce_);
    inner_->all_reduce_host(values, n, op);
  }

 private:
  std::unique_ptr<Comm> inner_;
  CollectiveWatchdog& dog_;
  // Names interned in the watchdog, so they outlive this Comm for a watcher reading one late.
  const char *all_reduce_, *all_gather_, *reduce_scatter_, *all_to_all_, *send_recv_, *send_,
      *recv_, *broadcast_, *barrier_, *host_reduce_;
};

}  // namespace

std::unique_ptr<Comm> watch(std::unique_ptr<Comm> inner, CollectiveWatchdog& dog) {
  MOP_CHECK(inner != nullptr, "watch() of a null Comm");
  return std::make_unique<WatchedComm>(std::move(inner), dog);
}

}  // namespace mop
