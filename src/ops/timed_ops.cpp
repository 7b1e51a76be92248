// TimedOps (see timed_ops.h). Device streams: a pool of timing event pairs (runtime.h) recorded
// around each op; when the pool fills up (or at collect()) the pairs are read and summed per
// category. The host: wall-clock time around each (synchronous) op.
#include "ops/timed_ops.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>


namespace mop {

double OpTimes::total() const {
  double t = 0;
  for (double s : seconds) t += s;
  return t;
}

std::string OpTimes::describe() const {
  std::string out;
  double all = total();
  for (int c = 0; c < kNumOpCategories; ++c) {
    char buf[96];
    std::snprintf(buf, sizeof buf, "%s%s %.0f ms (%.0f%%)", out.empty() ? "" : " | ",
                  op_category_name(OpCategory(c)), 1e3 * seconds[c], all > 0 ? 100 * seconds[c] / all : 0.0);
    out += buf;
  }
  return out;
}

namespace {
// "gemm(c, a, ...)" → "gemm".
std::string op_name(const char* call) {
  std::string s(call);
  return s.substr(0, s.find('('));
}
double host_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

struct TimedOps::Clock {
  OpTimes acc;
  bool tracing = false;
  double trace_t0 = 0;  // host steady-clock seconds at start_trace
  std::vector<TraceEvent> trace;
  const char* current_call = "";
  bool open = false;  // between begin() and end()
  OpCategory current = OpCategory::Other;
  StepPhase current_phase = StepPhase::Forward;
  std::chrono::steady_clock::time_point t0;
  // Device streams: a pool of timing event pairs, read when it fills up or at collect().
  static constexpr size_t kPairs = 2048;
  Stream stream;  // null: host timing
  std::vector<Event> events;
  std::vector<OpCategory> cats;
  std::vector<StepPhase> phases;
  std::vector<const char*> calls;
  Event trace_start;
  size_t used = 0;  // pairs recorded since the last flush

  void flush() {
    if (used == 0) return;
    events[2 * used - 1].synchronize();
    for (size_t i = 0; i < used; ++i) {
      const float ms = events[2 * i + 1].elapsed_ms_since(events[2 * i]);
      acc.seconds[int(cats[i])] += 1e-3 * ms;
      acc.phase_seconds[int(phases[i])] += 1e-3 * ms;
      if (tracing) {
        const float at = events[2 * i].elapsed_ms_since(trace_start);
        trace.push_back({op_name(calls[i]), op_category_name(cats[i]), "GPU compute stream", 1e-3 * at, 1e-3 * ms});
      }
    }
    used = 0;
  }
};

TimedOps::TimedOps(std::unique_ptr<Ops> inner)
    : Ops(inner->shared_backend()), inner_(std::move(inner)), clock_(new Clock) {
  set_observer(this);
  clock_->stream = inner_->stream();
  if (!clock_->stream.is_null()) {
    const Device d = clock_->stream.device();
    for (size_t i = 0; i < 2 * Clock::kPairs; ++i) clock_->events.emplace_back(d, /*timing=*/true);
    clock_->cats.resize(Clock::kPairs);
    clock_->phases.resize(Clock::kPairs);
    clock_->calls.resize(Clock::kPairs);
    clock_->trace_start = Event(d, /*timing=*/true);
  }
}

TimedOps::~TimedOps() = default;

void TimedOps::begin(OpCategory c, const char* call) {
  // Intervals do not nest: an op or collective issued inside another would be counted twice (and
  // on the GPU would leave an event pair half recorded).
  MOP_CHECK(!clock_->open, "TimedOps: ", call, " begins inside ", clock_->current_call);
  clock_->open = true;
  if (forced_ >= 0 && c != OpCategory::Communication) c = OpCategory(forced_);
  clock_->current_call = call;
  if (!clock_->stream.is_null()) {
    if (clock_->used == Clock::kPairs) clock_->flush();
    clock_->cats[clock_->used] = c;
    clock_->phases[clock_->used] = phase_;
    clock_->calls[clock_->used] = call;
    clock_->events[2 * clock_->used].record(clock_->stream);
    return;
  }
  clock_->current = c;
  clock_->current_phase = phase_;
  clock_->t0 = std::chrono::steady_clock::now();
}

void TimedOps::end() {
  clock_->open = false;
  if (!clock_->stream.is_null()) {
    clock_->events[2 * clock_->used + 1].record(clock_->stream);
    ++clock_->used;
    return;
  }
  double dt = std::chrono::duration<double>(std::chrono::steady_clock::now() - clock_->t0).count();
  clock_->acc.seconds[int(clock_->current)] += dt;
  clock_->acc.phase_seconds[int(clock_->current_phase)] += dt;
  if (clock_->tracing) {
    double start = std::chrono::duration<double>(clock_->t0.time_since_epoch()).count() - clock_->trace_t0;
    clock_->trace.push_back({op_name(clock_->current_call), op_category_name(clock_->current), "CPU ops", start, dt});
  }
}

void TimedOps::start_trace() {
  clock_->tracing = true;
  clock_->trace.clear();
  if (!clock_->stream.is_null()) {
    clock_->flush();  // earlier ops are not part of the trace
    clock_->trace_start.record(clock_->stream);
  }
  clock_->trace_t0 = host_now();
}

std::vector<TraceEvent> TimedOps::stop_trace() {
  clock_->flush();  // the traced ops' times also stay in acc for collect()
  clock_->tracing = false;
  return std::move(clock_->trace);
}

double TimedOps::trace_host_start() const { return clock_->trace_t0; }

void write_chrome_trace(const std::string& path, const std::vector<TraceEvent>& events) {
  std::ofstream out(path);
  MOP_USER_CHECK(out.good(), "cannot write the trace ", path);
  std::vector<std::string> tracks;
  out << "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[";
  bool first = true;
  for (const TraceEvent& e : events) {
    size_t tid = std::find(tracks.begin(), tracks.end(), e.track) - tracks.begin();
    if (tid == tracks.size()) tracks.push_back(e.track);
    std::string name;
    for (char ch : e.name) name += (ch == '"' || ch == '\\') ? ' ' : ch;
    char buf[256];
    std::snprintf(buf, sizeof buf, "%s{\"name\":\"%s\",\"cat\":\"%s\",\"ph\":\"X\",\"pid\":0,\"tid\":%zu,\"ts\":%.3f,\"dur\":%.3f}",
                  first ? "" : ",", name.c_str(), e.category.c_str(), tid, 1e6 * e.start, 1e6 * e.duration);
    out << buf;
    first = false;
  }
  for (size_t t = 0; t < tracks.size(); ++t)
    out << (first && t == 0 ? "" : ",") << "{\"name\":\"thread_name\",\"ph\":\"M\",\"pid\":0,\"tid\":" << t
        << ",\"args\":{\"name\":\"" << tracks[t] << "\"}}";
  out << "]}\n";
}

OpTimes TimedOps::collect() {
  clock_->flush();
  OpTimes out = clock_->acc;
  clock_->acc = OpTimes{};
  return out;
}

}  // namespace mop
