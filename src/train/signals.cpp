// The process-wide stop flag and its handlers (see signals.h).
#include "train/signals.h"

#include <atomic>
#include <csignal>

namespace mop {

namespace {

std::atomic<int> g_stop_signal{0};
extern "C" void on_stop_signal(int sig) { g_stop_signal.store(sig); }
int g_stop_signals_depth = 0;  // StopSignals alive (constructed and destroyed on the main thread)
constexpr int kStopSignals[3] = {SIGTERM, SIGINT, SIGUSR1};

}  // namespace

StopSignals::StopSignals() {
  if (g_stop_signals_depth++ > 0) return;
  g_stop_signal.store(0);
  for (int i = 0; i < 3; ++i) prev_[i] = std::signal(kStopSignals[i], on_stop_signal);
}

StopSignals::~StopSignals() {
  if (--g_stop_signals_depth > 0) return;
  for (int i = 0; i < 3; ++i) std::signal(kStopSignals[i], prev_[i]);
}

int pending_stop_signal() { return g_stop_signal.load(); }

}  // namespace mop
