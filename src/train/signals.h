// Stop requests by signal: while a StopSignals is alive, SIGTERM, SIGINT and SIGUSR1 (Slurm's usual
// preemption notice) set a process-wide flag instead of ending the process, and
// pending_stop_signal() reads it. Trainer::run turns the flag into a stop at a step boundary.
#pragma once

namespace mop {

// While one is alive, SIGTERM, SIGINT and SIGUSR1 request a stop instead of ending the process:
// Trainer::run stops at the next step boundary with a checkpoint, or before its first step when
// the signal came during start-up (loading a large checkpoint can take minutes; the run then exits
// 0 and a requeue resumes). `mop train` holds one from before MPI starts (main.cpp), Trainer::run
// one more; the outermost clears the flag when it begins and restores the previous handlers.
class StopSignals {
 public:
  StopSignals();
  ~StopSignals();
  StopSignals(const StopSignals&) = delete;
  StopSignals& operator=(const StopSignals&) = delete;

 private:
  using Handler = void (*)(int);
  Handler prev_[3] = {};
};

// The last stop signal received since the outermost StopSignals began (0: none). This rank's
// only: a run agrees on it over its ranks (Trainer::stop_requested).
int pending_stop_signal();

}  // namespace mop
