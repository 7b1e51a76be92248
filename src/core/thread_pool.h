// ThreadPool: persistent worker threads, each pinned to one CPU, running range jobs. A job over
// [0, n) is cut into contiguous chunks that idle workers claim in submission order. submit()
// returns a ticket at once and wait(ticket) blocks until that job is done, so a caller can keep
// several jobs in flight (per-layer host optimizer updates while the GPU runs backward) and wait
// for each only where its result is needed. Threads are created once, in the constructor.
#pragma once

#include <cfenv>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace mop {

// The CPUs this thread may run on (sched_getaffinity), ascending. Under mpirun this is the rank's
// binding: with `--bind-to none` every rank sees the whole host (then split it with cpu_share),
// with `--map-by ...:pe=K` each rank sees its own K cores.
std::vector<int> allowed_cpus();

// Part `part_idx` of `num_parts` contiguous, near-equal slices of `cpus` (the first parts get one
// more when it does not divide): local rank r of R ranks that all see the same CPUs takes
// cpu_share(allowed_cpus(), r, R). Never empty: with more parts than CPUs, parts share CPUs.
std::vector<int> cpu_share(const std::vector<int>& cpus, int part_idx, int num_parts);

class ThreadPool {
 public:
  using Ticket = uint64_t;
  // fn(begin, end) handles elements [begin, end) of the job. It must not throw (a throw ends the
  // process): validate arguments before submitting.
  using RangeFn = std::function<void(int64_t begin, int64_t end)>;

  // num_threads workers (≤ 0: one per CPU in `cpus`), worker i pinned to cpus[i % cpus.size()].
  // Empty `cpus`: allowed_cpus() of the constructing thread.
  explicit ThreadPool(int num_threads = 0, std::vector<int> cpus = {});
  // Runs every job already submitted to completion, then joins the workers.
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int num_threads() const { return int(threads_.size()); }
  // The CPU worker i is pinned to.
  const std::vector<int>& worker_cpus() const { return worker_cpus_; }

  // Queues fn over [0, n) in chunks of `chunk` elements (the last may be shorter); returns at
  // once. Chunks run under the submitting thread's floating-point environment (rounding mode,
  // flush-to-zero), so a job computes what it would compute on the caller.
  Ticket submit(int64_t n, int64_t chunk, RangeFn fn);
  // Blocks until job `ticket` is done (its writes are then visible to the caller). Not to be
  // called from inside a job.
  void wait(Ticket ticket);
  void wait_all();
  bool done(Ticket ticket) const;
  void run(int64_t n, int64_t chunk, RangeFn fn) { wait(submit(n, chunk, std::move(fn))); }

 private:
  struct Job {
    RangeFn fn;
    int64_t n = 0, chunk = 0, num_chunks = 0;
    int64_t next_chunk = 0;   // chunks [0, next_chunk) are claimed
    int64_t chunks_done = 0;  // finished chunks
    std::fenv_t env;          // the submitter's floating-point environment
  };
  void worker_loop();
  bool claim(Job*& job, int64_t& chunk_idx);  // under mu_
  bool is_done(Ticket ticket) const;          // under mu_
  void retire();                              // under mu_: drop finished jobs from the front

  mutable std::mutex mu_;
  std::condition_variable work_cv_, done_cv_;
  // Jobs with tickets [first_ticket_, first_ticket_ + jobs_.size()), in submission order; a job
  // leaves once it and every earlier job are done. std::deque keeps references to its elements
  // valid across push_back/pop_front, so a worker can run a chunk outside the lock.
  std::deque<Job> jobs_;
  Ticket first_ticket_ = 1;
  Ticket claim_ticket_ = 1;  // the first job that may still have unclaimed chunks
  bool stop_ = false;
  std::vector<int> worker_cpus_;
  std::vector<std::thread> threads_;
};

}  // namespace mop
