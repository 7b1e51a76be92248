// ThreadPool: workers pinned with pthread_setaffinity_np, one mutex for the job queue. A chunk is
// tens of microseconds of work or more, so one lock per claimed chunk costs nothing measurable
// and keeps the bookkeeping obviously correct.
#include "core/thread_pool.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <cstring>
#include <string>

#include "core/error.h"

namespace mop {

std::vector<int> allowed_cpus() {
  cpu_set_t set;
  CPU_ZERO(&set);
  MOP_CHECK(sched_getaffinity(0, sizeof set, &set) == 0,
            "sched_getaffinity: ", std::strerror(errno));
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &set)) cpus.push_back(c);
  MOP_CHECK(!cpus.empty(), "sched_getaffinity returned no CPU");
  return cpus;
}

std::vector<int> cpu_share(const std::vector<int>& cpus, int part_idx, int num_parts) {
  MOP_CHECK(!cpus.empty() && num_parts > 0 && 0 <= part_idx && part_idx < num_parts,
            "cpu_share: part ", part_idx, " of ", num_parts, " over ", cpus.size(), " CPUs");
  const int n = int(cpus.size());
  if (num_parts > n) return {cpus[part_idx % n]};
  const int base = n / num_parts, extra = n % num_parts;
  const int begin = part_idx * base + std::min(part_idx, extra);
  const int size = base + (part_idx < extra ? 1 : 0);
  return std::vector<int>(cpus.begin() + begin, cpus.begin() + begin + size);
}

ThreadPool::ThreadPool(int num_threads, std::vector<int> cpus) {
  if (cpus.empty()) cpus = allowed_cpus();
  if (num_threads <= 0) num_threads = int(cpus.size());
  for (int i = 0; i < num_threads; ++i) worker_cpus_.push_back(cpus[size_t(i) % cpus.size()]);
  for (int c : cpus) MOP_CHECK(0 <= c && c < CPU_SETSIZE, "ThreadPool: no CPU ", c);
  threads_.reserve(size_t(num_threads));
  for (int i = 0; i < num_threads; ++i) {
    threads_.emplace_back([this] { worker_loop(); });
    // Pinned from here, not from inside the worker, so a CPU outside this process's allowed set
    // fails the constructor instead of a worker thread.
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(worker_cpus_[size_t(i)], &set);
    const int rc = pthread_setaffinity_np(threads_.back().native_handle(), sizeof set, &set);
    if (rc != 0) {
      {
        std::lock_guard<std::mutex> lk(mu_);
        stop_ = true;
      }
      work_cv_.notify_all();
      for (std::thread& t : threads_) t.join();
      MOP_CHECK(false, "pinning a pool thread to CPU ", worker_cpus_[size_t(i)], ": ",
                std::strerror(rc));
    }
    const std::string name = "mop-pool-" + std::to_string(i);  // shown by top -H and profilers
    pthread_setname_np(threads_.back().native_handle(), name.substr(0, 15).c_str());
  }
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  work_cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

ThreadPool::Ticket ThreadPool::submit(int64_t n, int64_t chunk, RangeFn fn) {
  MOP_CHECK(n >= 0 && chunk > 0, "ThreadPool::submit: n=", n, " chunk=", chunk);
  Job job;
  job.fn = std::move(fn);
  job.n = n;
  job.chunk = chunk;
  job.num_chunks = (n + chunk - 1) / chunk;
  std::fegetenv(&job.env);
  Ticket ticket;
  {
    std::lock_guard<std::mutex> lk(mu_);
    ticket = first_ticket_ + jobs_.size();
    jobs_.push_back(std::move(job));
    if (jobs_.back().num_chunks == 0) retire();  // nothing to run: done at once
  }
  work_cv_.notify_all();
  return ticket;
}

bool ThreadPool::claim(Job*& job, int64_t& chunk_idx) {
  claim_ticket_ = std::max(claim_ticket_, first_ticket_);
  while (claim_ticket_ < first_ticket_ + jobs_.size()) {
    Job& j = jobs_[claim_ticket_ - first_ticket_];
    if (j.next_chunk < j.num_chunks) {
      job = &j;
      chunk_idx = j.next_chunk++;
      if (j.next_chunk == j.num_chunks) ++claim_ticket_;
      return true;
    }
    ++claim_ticket_;
  }
  return false;
}

bool ThreadPool::is_done(Ticket ticket) const {
  MOP_CHECK(ticket > 0 && ticket < first_ticket_ + jobs_.size(), "unknown ticket ", ticket);
  if (ticket < first_ticket_) return true;
  const Job& j = jobs_[ticket - first_ticket_];
  return j.chunks_done == j.num_chunks;
}

void ThreadPool::retire() {
  while (!jobs_.empty() && jobs_.front().chunks_done == jobs_.front().num_chunks) {
    jobs_.pop_front();
    ++first_ticket_;
  }
}

void ThreadPool::worker_loop() {
  std::unique_lock<std::mutex> lk(mu_);
  for (;;) {
    Job* job = nullptr;
    int64_t chunk_idx = 0;
    work_cv_.wait(lk, [&] { return claim(job, chunk_idx) || stop_; });
    if (!job) return;  // stopping and nothing left to claim
    lk.unlock();
    std::fesetenv(&job->env);
    const int64_t begin = chunk_idx * job->chunk;
    job->fn(begin, std::min(job->n, begin + job->chunk));
    lk.lock();
    if (++job->chunks_done == job->num_chunks) {
      retire();
      done_cv_.notify_all();
    }
  }
}

void ThreadPool::wait(Ticket ticket) {
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return is_done(ticket); });
}

void ThreadPool::wait_all() {
  std::unique_lock<std::mutex> lk(mu_);
  done_cv_.wait(lk, [&] { return jobs_.empty(); });
}

bool ThreadPool::done(Ticket ticket) const {
  std::lock_guard<std::mutex> lk(mu_);
  return is_done(ticket);
}

}  // namespace mop
