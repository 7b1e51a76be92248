// TimedOps (see timed_ops.h). Device streams: a pool of timing event pairs (runtime.h) recorded
// around each op; when the pool fills up (or at collect()) the pairs are read and summed per
// category. The host: wall-clock time around each (synchronous) op.
#include "ops/timed_ops.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <fstream>


namespace mop {

const char* op_category_name(OpCategory c) {
  switch (c) {
    case OpCategory::Attention: return "attention";
    case OpCategory::DenseGemm: return "dense GEMMs";
    case OpCategory::Experts: return "experts";
    case OpCategory::RouterPermute: return "router/permute";
    case OpCategory::Loss: return "LM head+loss";
    case OpCategory::Optimizer: return "optimizer";
    case OpCategory::Communication: return "communication";
    case OpCategory::Other: return "other";
  }
  return "?";
}

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

TimedOps::TimedOps(std::unique_ptr<Ops> inner) : inner_(std::move(inner)), clock_(new Clock) {
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

// Each forwarding method times its op under one category.
#define MOP_TIMED(cat, call)     \
  do {                           \
    begin(OpCategory::cat, #call); \
    inner_->call;            \
    end();                   \
  } while (0)

void TimedOps::fill(Tensor x, double v) { MOP_TIMED(Other, fill(x, v)); }
void TimedOps::copy(Tensor dst, const Tensor& src) { MOP_TIMED(Other, copy(dst, src)); }
void TimedOps::add(Tensor out, const Tensor& a, const Tensor& b) { MOP_TIMED(Other, add(out, a, b)); }
void TimedOps::sumsq(Tensor out, const Tensor& x) { MOP_TIMED(Optimizer, sumsq(out, x)); }
void TimedOps::sum(Tensor out, const Tensor& x) { MOP_TIMED(Loss, sum(out, x)); }
void TimedOps::gemm(Tensor c, const Tensor& a, bool ta, const Tensor& b, bool tb, float alpha, float beta) {
  MOP_TIMED(DenseGemm, gemm(c, a, ta, b, tb, alpha, beta));
}
void TimedOps::grouped_gemm_fwd(Tensor y, const Tensor& x, const Tensor& w, const Tensor& o) {
  MOP_TIMED(Experts, grouped_gemm_fwd(y, x, w, o));
}
void TimedOps::grouped_gemm_bwd_data(Tensor dx, const Tensor& dy, const Tensor& w, const Tensor& o) {
  MOP_TIMED(Experts, grouped_gemm_bwd_data(dx, dy, w, o));
}
void TimedOps::grouped_gemm_bwd_weight(Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& o,
                                       bool accumulate) {
  MOP_TIMED(Experts, grouped_gemm_bwd_weight(dw, dy, x, o, accumulate));
}
void TimedOps::embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) {
  MOP_TIMED(Other, embedding_fwd(out, ids, table));
}
void TimedOps::embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) {
  MOP_TIMED(Other, embedding_bwd(dtable, ids, dout));
}
void TimedOps::rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) {
  MOP_TIMED(Other, rmsnorm_fwd(y, rstd, x, w, eps));
}
void TimedOps::rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                           const Tensor& rstd, bool acc) {
  MOP_TIMED(Other, rmsnorm_bwd(dx, dw, dy, x, w, rstd, acc));
}
void TimedOps::rope_fwd(Tensor x, const Tensor& pos, float theta) { MOP_TIMED(Attention, rope_fwd(x, pos, theta)); }
void TimedOps::rope_bwd(Tensor dx, const Tensor& pos, float theta) { MOP_TIMED(Attention, rope_bwd(dx, pos, theta)); }
void TimedOps::attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                             int batch, float scale, bool causal) {
  MOP_TIMED(Attention, attention_fwd(out, lse, q, k, v, batch, scale, causal));
}
void TimedOps::attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                             const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                             int batch, float scale, bool causal) {
  MOP_TIMED(Attention, attention_bwd(dq, dk, dv, dout, q, k, v, out, lse, batch, scale, causal));
}
void TimedOps::attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                               int batch) {
  MOP_TIMED(Attention, attention_merge(out_acc, lse_acc, o, lse, batch));
}
void TimedOps::swiglu_fwd(Tensor h, const Tensor& gu) { MOP_TIMED(Experts, swiglu_fwd(h, gu)); }
void TimedOps::swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) { MOP_TIMED(Experts, swiglu_bwd(dgu, dh, gu)); }
void TimedOps::router_fwd(Tensor idx, Tensor w, Tensor probs, Tensor lse, const Tensor& logits, bool renorm) {
  MOP_TIMED(RouterPermute, router_fwd(idx, w, probs, lse, logits, renorm));
}
void TimedOps::router_bwd(Tensor dlogits, const Tensor& dw, const Tensor& probs, const Tensor& lse,
                          const Tensor& idx, const Tensor& w, const Tensor& aux_grad, float z, bool renorm) {
  MOP_TIMED(RouterPermute, router_bwd(dlogits, dw, probs, lse, idx, w, aux_grad, z, renorm));
}
void TimedOps::moe_aux_loss(Tensor losses, Tensor aux_grad, const Tensor& probs, const Tensor& lse,
                            const Tensor& counts, int k, float aux, float z) {
  MOP_TIMED(RouterPermute, moe_aux_loss(losses, aux_grad, probs, lse, counts, k, aux, z));
}
void TimedOps::moe_route_plan(Tensor counts, Tensor offsets, Tensor perm, Tensor slot, const Tensor& idx) {
  MOP_TIMED(RouterPermute, moe_route_plan(counts, offsets, perm, slot, idx));
}
void TimedOps::moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm) {
  MOP_TIMED(RouterPermute, moe_permute_fwd(xp, x, perm));
}
void TimedOps::moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot, int k, bool acc) {
  MOP_TIMED(RouterPermute, moe_permute_bwd(dx, dxp, slot, k, acc));
}
void TimedOps::moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot, const Tensor& w, bool acc) {
  MOP_TIMED(RouterPermute, moe_unpermute_fwd(y, yp, slot, w, acc));
}
void TimedOps::moe_unpermute_bwd(Tensor dyp, Tensor dw, const Tensor& dy, const Tensor& yp,
                                 const Tensor& slot, const Tensor& w) {
  MOP_TIMED(RouterPermute, moe_unpermute_bwd(dyp, dw, dy, yp, slot, w));
}
void TimedOps::lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                             const Tensor& targets, Tensor ws) {
  MOP_TIMED(Loss, lmhead_ce_fwd(loss, lse, x, w, targets, ws));
}
void TimedOps::lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
                             const Tensor& targets, const Tensor& lse, float scale, Tensor ws) {
  MOP_TIMED(Loss, lmhead_ce_bwd(dx, dw, x, w, targets, lse, scale, ws));
}
void TimedOps::lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                                 const Tensor& w, const Tensor& targets, float scale, Tensor ws) {
  MOP_TIMED(Loss, lmhead_ce_fwd_bwd(loss, lse, dx, dw, x, w, targets, scale, ws));
}
void TimedOps::adamw_step(Tensor p, Tensor m, Tensor v, const Tensor& g, const AdamWArgs& a) {
  MOP_TIMED(Optimizer, adamw_step(p, m, v, g, a));
}
void TimedOps::adamw_step_cast(Tensor p, Tensor m, Tensor v, const Tensor& g, const AdamWArgs& a,
                               Tensor w) {
  MOP_TIMED(Optimizer, adamw_step_cast(p, m, v, g, a, w));
}

}  // namespace mop
