// Plan search (see search.h): the cross product of the open keys' values, each planned with
// make_plan (without the fit check), split into fitting and rejected plans; and what would make a
// plan fit where none does (other world sizes, the nearest batch size that divides).
#include "plan/search.h"

#include <algorithm>
#include <atomic>
#include <exception>
#include <cstdio>
#include <map>
#include <set>
#include <thread>

#include "core/error.h"

namespace mop {

namespace {

std::vector<int64_t> divisors(int64_t n) {
  std::vector<int64_t> d;
  for (int64_t i = 1; i <= n; ++i)
    if (n % i == 0) d.push_back(i);
  return d;
}

template <class T>
std::vector<T> one(T v) {
  return {v};
}

std::string number(double x) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "%g", x);
  return buf;
}

// Removes the line of `key` ("gradients:") from a dumped config.
void erase_key(std::string& text, const std::string& key) {
  const size_t at = text.find("  " + key);
  if (at == std::string::npos) return;
  text.erase(at, text.find('\n', at) - at);
}

}  // namespace

namespace {

// The candidates of the search with parallel.pp as `base` gives it, not yet planned: `out` gets
// the open keys (and, where the foldings cannot multiply to the ranks, the one rejected candidate
// that says so).
std::vector<Candidate> candidates(const Config& base, const Machine& machine, int world, SearchResult& out);
// Plans every candidate, on every core (each plan a pure function of its config).
void plan_candidates(std::vector<Candidate>& todo, const Machine& machine, int world);
// The planned candidates into `out`: rejected, or feasible (once per distinct plan), fastest first.
void collect(std::vector<Candidate>& todo, SearchResult& out);

SearchResult search_one_pipeline(const Config& base, const Machine& machine, int world) {
  SearchResult out;
  std::vector<Candidate> todo = candidates(base, machine, world, out);
  plan_candidates(todo, machine, world);
  collect(todo, out);
  return out;
}

// Fastest first; of plans equally fast, the one that takes less memory (device, then host).
void rank_fastest(std::vector<Candidate>& plans) {
  std::stable_sort(plans.begin(), plans.end(), [](const Candidate& x, const Candidate& y) {
    if (x.plan.time.step != y.plan.time.step) return x.plan.time.step < y.plan.time.step;
    if (x.plan.memory.device_total() != y.plan.memory.device_total())
      return x.plan.memory.device_total() < y.plan.memory.device_total();
    return x.plan.memory.host_total() < y.plan.memory.host_total();
  });
}

// A pipeline layout the search tries: stages, schedule, chunks per rank.
struct PipeChoice {
  int64_t pp = 1;
  std::string schedule = "1f1b";
  int64_t chunks = 1;
};

// "pp 12 interleaved × 2, " before a pipelined candidate's settings.
std::string pipe_label(int64_t pp, int64_t chunks) {
  return pp > 1 ? "pp " + std::to_string(pp) + (chunks > 1 ? " interleaved × " + std::to_string(chunks) : "") + ", "
                : "";
}

// The fastest interleaved plans that the search tries again over more chunks per rank.
constexpr size_t kDeeperPlans = 4;

std::vector<PipeChoice> pipe_choices(const Config& base, const Machine& machine, int world, bool open) {
  if (!open) return {{base.parallel.pp, base.parallel.pipeline.schedule, base.parallel.pipeline.virtual_stages}};
  std::vector<PipeChoice> out = {{1, "1f1b", 1}};
  const int64_t segments = base.model.num_layers + 2, node = std::max(1, std::min(machine.gpus_per_node, world));
  for (int64_t pp : divisors(world)) {
    if (pp == 1 || pp > segments || (world / pp) % node != 0 || base.model.tie_embeddings) continue;
    out.push_back({pp, "1f1b", 1});
    if (2 * pp <= segments) out.push_back({pp, "interleaved", 2});
  }
  return out;
}

}  // namespace

SearchResult search_plans(const Config& base, const Machine& machine, int world, bool pipelines) {
  SearchResult out;
  const bool open_pp = pipelines && !base.is_pinned("parallel.pp");
  if (!open_pp) return search_one_pipeline(base, machine, world);
  out.open_keys.push_back("parallel.pp");
  // Every pipeline's candidates planned together (one pool keeps every core busy), then taken
  // pipeline by pipeline in order.
  const std::vector<PipeChoice> pipes = pipe_choices(base, machine, world, open_pp);
  std::vector<SearchResult> results(pipes.size());
  std::vector<Candidate> all;
  std::vector<size_t> begin;
  for (size_t i = 0; i < pipes.size(); ++i) {
    const PipeChoice& pipe = pipes[i];
    Config c = base;
    c.parallel.pp = pipe.pp, c.parallel.pipeline.schedule = pipe.schedule;
    c.parallel.pipeline.virtual_stages = pipe.chunks;
    c.pinned.insert("parallel.pp");
    // Pipelines multiply the search: past pp 1 the keys that mostly trade memory for time take the
    // values the plans without pp pick most (state auto, gradients auto, the exchange in 4 chunks
    // under a budget of 2), and micro-batches of one sequence (the most micro-batches, the smallest
    // bubble), unless the config gives them.
    auto hold = [&](const char* key, auto set) {
      if (pipe.pp == 1 || c.is_pinned(key)) return;
      set();
      c.pinned.insert(key);
    };
    hold("optim.state_placement", [&] { c.optim.state_placement = "auto"; });
    hold("optim.gradients", [&] { c.optim.gradients = "auto"; });
    hold("parallel.moe.chunks", [&] { c.parallel.moe.chunks = 4; });
    hold("parallel.moe.exchange_budget", [&] { c.parallel.moe.exchange_budget = 2; });
    hold("train.micro_batch_size", [&] { c.train.micro_batch_size = 1; });  // the most micro-batches
    begin.push_back(all.size());
    for (Candidate& x : candidates(c, machine, world, results[i])) all.push_back(std::move(x));
  }
  begin.push_back(all.size());
  plan_candidates(all, machine, world);
  for (size_t i = 0; i < pipes.size(); ++i) {
    const PipeChoice& pipe = pipes[i];
    SearchResult& r = results[i];
    std::vector<Candidate> todo(std::make_move_iterator(all.begin() + long(begin[i])),
                                std::make_move_iterator(all.begin() + long(begin[i + 1])));
    collect(todo, r);
    const std::string label = pipe_label(pipe.pp, pipe.chunks);
    for (auto [from, to] : {std::pair{&r.feasible, &out.feasible}, {&r.rejected, &out.rejected}})
      for (Candidate& x : *from) {
        x.settings = label + x.settings;
        to->push_back(std::move(x));
      }
    if (out.open_keys.size() == 1)
      for (const std::string& k : r.open_keys)
        if (k != "parallel.pp") out.open_keys.push_back(k);
  }
  rank_fastest(out.feasible);
  // Deeper interleaving, for the fastest interleaved plans only (each chunk count more would
  // double the search): the same settings over 3 and 4 chunks per rank.
  std::vector<Candidate> deeper;
  const int64_t segments = base.model.num_layers + 2;
  for (const Candidate& x : out.feasible) {
    const auto& pl = x.cfg.parallel;
    if (pl.pipeline.schedule != "interleaved" || pl.pipeline.virtual_stages != 2) continue;
    const std::string settings = x.settings.substr(pipe_label(pl.pp, 2).size());
    for (int64_t chunks : {3, 4}) {
      if (pl.pp * chunks > segments) continue;
      Candidate d;
      d.cfg = x.cfg;
      d.cfg.parallel.pipeline.virtual_stages = chunks;
      d.settings = pipe_label(pl.pp, chunks) + settings;
      deeper.push_back(std::move(d));
    }
    if (deeper.size() >= 2 * kDeeperPlans) break;
  }
  plan_candidates(deeper, machine, world);
  SearchResult r;
  collect(deeper, r);
  for (auto [from, to] : {std::pair{&r.feasible, &out.feasible}, {&r.rejected, &out.rejected}})
    for (Candidate& x : *from) to->push_back(std::move(x));
  rank_fastest(out.feasible);
  return out;
}

namespace {

std::vector<Candidate> candidates(const Config& base, const Machine& machine, int world, SearchResult& out) {
  auto open = [&](const char* key) {
    const bool o = !base.is_pinned(key);
    if (o) out.open_keys.push_back(key);
    return o;
  };
  const auto& a = base.parallel.attention;
  const auto& e = base.parallel.moe;
  const bool open_cp = open("parallel.attention.cp"), open_dp = open("parallel.attention.dp");
  const bool open_impl = open("parallel.attention.impl");
  const bool open_ep = open("parallel.moe.ep"), open_edp = open("parallel.moe.dp");
  const bool open_chunks = open("parallel.moe.chunks");
  const bool open_zero = open("parallel.zero");
  const bool open_mb = open("train.micro_batch_size");
  const bool open_recompute = open("train.recompute");
  const bool open_state = open("optim.state_placement");
  const bool open_shard = open("parallel.shard");
  const bool open_grads = open("optim.gradients");
  const bool open_budget = open("parallel.moe.exchange_budget");
  // Streamed gradients need a GPU and state on the host.
  const bool gpu = machine.device.kind == Device::CUDA && base.train.device != "cpu";

  // Attention foldings: cp × dp = the ranks of a pipeline stage (parallel.pp as the config gives it).
  const int64_t stage = base.parallel.pp >= 1 && world % base.parallel.pp == 0 ? world / base.parallel.pp : world;
  std::vector<std::pair<int64_t, int64_t>> attn;
  for (int64_t cp : divisors(int(stage))) {
    const int64_t dp = stage / cp;
    if ((!open_cp && cp != a.cp) || (!open_dp && dp != a.dp)) continue;
    attn.push_back({cp, dp});
  }
  std::vector<std::pair<int64_t, int64_t>> moe;
  for (int64_t ep : divisors(int(stage))) {
    const int64_t dp = stage / ep;
    if ((!open_ep && ep != e.ep) || (!open_edp && dp != e.dp)) continue;
    moe.push_back({ep, dp});
  }
  if (attn.empty() || moe.empty()) {
    Candidate c;
    c.settings = "the config's foldings";
    c.group = "invalid settings";
    c.why = "parallel.attention (cp " + std::to_string(a.cp) + " × dp " + std::to_string(a.dp) +
            ") and parallel.moe (ep " + std::to_string(e.ep) + " × dp " + std::to_string(e.dp) +
            ") must multiply to the " + std::to_string(stage) + " ranks" +
            (stage < world ? " of a pipeline stage" : "");
    out.rejected.push_back(c);
    return {};
  }
  std::vector<Candidate> todo;  // every candidate, in the search's order
  // Sliced parameters keep no owners: ZeRO is not a choice beside them.
  struct Sharding {
    std::string shard;
    bool zero;
  };
  std::vector<Sharding> shardings;
  for (const std::string& shard : open_shard && world > 1 ? std::vector<std::string>{"owner", "slice"}
                                                          : one(base.parallel.shard)) {
    if (shard == "slice" && !open_zero) shardings.push_back({shard, base.parallel.zero});
    else if (shard == "slice") shardings.push_back({shard, true});
    else
      for (bool zero : open_zero && world > 1 ? std::vector<bool>{true, false} : one(base.parallel.zero))
        shardings.push_back({shard, zero});
  }
  for (auto [cp, dp] : attn)
    for (const std::string& impl : open_impl && cp > 1 ? std::vector<std::string>{"ulysses", "ring"}
                                                       : one(a.impl))
      for (auto [ep, edp] : moe)
        for (int64_t chunks : open_chunks && ep > 1 ? std::vector<int64_t>{1, 2, 4} : one(e.chunks))
          for (double budget : open_budget && ep > 1 ? std::vector<double>{0, 2} : one(e.exchange_budget))
            for (const Sharding& sh : shardings)
              for (bool recompute : open_recompute ? std::vector<bool>{false, true} : one(base.train.recompute)) {
                std::vector<int64_t> mbs;
                if (open_mb) {
                  const int64_t per_dp = base.train.global_batch_size / dp;
                  for (int64_t mb : divisors(std::max<int64_t>(per_dp, 1)))
                    if (mb <= 8 && base.train.global_batch_size % dp == 0) mbs.push_back(mb);
                  if (mbs.empty()) mbs.push_back(1);
                } else {
                  mbs.push_back(base.train.micro_batch_size);
                }
                for (int64_t mb : mbs)
                  for (const std::string& state : open_state ? std::vector<std::string>{"auto", "gpu", "host"}
                                                             : one(base.optim.state_placement))
                    // Sliced experts (edp > 1) leave nothing whole to stream.
                    for (const std::string& grads : open_grads ? (gpu && state != "gpu" &&
                                                                          !(sh.shard == "slice" && edp > 1)
                                                                      ? std::vector<std::string>{"gpu", "host"}
                                                                      : one(std::string("gpu")))
                                                               : one(base.optim.gradients)) {
                      Config c = base;
                      c.parallel.attention.cp = cp, c.parallel.attention.dp = dp;
                      c.parallel.attention.impl = cp > 1 ? impl : a.impl;
                      c.parallel.moe.ep = ep, c.parallel.moe.dp = edp;
                      c.parallel.moe.chunks = ep > 1 ? chunks : e.chunks;
                      c.parallel.moe.exchange_budget = ep > 1 ? budget : e.exchange_budget;
                      c.parallel.zero = sh.zero;
                      c.parallel.shard = sh.shard;
                      c.train.recompute = recompute;
                      c.train.micro_batch_size = mb;
                      c.optim.state_placement = state;
                      c.optim.gradients = grads;
                      c.train.plan = "config";
                      Candidate cand;
                      cand.settings = "cp " + std::to_string(cp) + (cp > 1 ? " " + impl : std::string()) +
                                      ", ep " + std::to_string(ep) +
                                      (ep > 1 ? " chunks " + std::to_string(chunks) : std::string()) +
                                      (ep > 1 && budget > 0 ? " budget " + number(budget) : std::string()) +
                                      ", micro-batch " + std::to_string(mb) + (recompute ? ", recompute" : "") +
                                      (sh.shard == "slice" ? ", slice" : world > 1 && sh.zero ? ", zero" : "") +
                                      ", state " + state + (grads == "host" ? ", grads host" : "");
                      cand.cfg = c;
                      todo.push_back(std::move(cand));
                    }
              }
  return todo;
}

void plan_candidates(std::vector<Candidate>& todo, const Machine& machine, int world) {
  std::vector<std::exception_ptr> failed(todo.size());  // an internal error, raised here below
  std::atomic<size_t> next{0};
  auto work = [&] {
    for (size_t i; (i = next.fetch_add(1)) < todo.size();) {
      Candidate& cand = todo[i];
      try {
        cand.plan = make_plan(cand.cfg, machine, world, Fit::Time);
        cand.why = plan_overflow(cand.plan, &cand.group);
        if (!cand.why.empty()) cand.plan = Plan{};  // a rejected plan is its reason (search.h)
      } catch (const UserError& err) {
        cand.why = err.what();
        cand.group = "invalid settings";
      } catch (...) {
        failed[i] = std::current_exception();
      }
    }
  };
  {
    const unsigned threads = std::max(1u, std::min(std::thread::hardware_concurrency(), 16u));
    std::vector<std::thread> pool;
    for (unsigned t = 1; t < threads && todo.size() > 1; ++t) pool.emplace_back(work);
    work();
    for (std::thread& t : pool) t.join();
  }
  for (const std::exception_ptr& e : failed)
    if (e) std::rethrow_exception(e);
}

void collect(std::vector<Candidate>& todo, SearchResult& out) {
  std::set<std::string> seen;  // plans that came out the same (auto placement = gpu, …)
  for (Candidate& cand : todo) {
    if (!cand.why.empty()) {
      out.rejected.push_back(std::move(cand));
      continue;
    }
    // The same resolved plan under another name (auto placement that put everything on the GPU
    // is the gpu plan; streaming with nothing on the host is not streaming) is listed once.
    std::string key = dump_config(cand.cfg);
    erase_key(key, "state_placement:");
    erase_key(key, "gradients:");
    for (bool h : cand.plan.segment_on_host) key += h ? 'h' : 'g';
    key += cand.plan.stream_grads ? 's' : 'w';
    if (!seen.insert(key).second) continue;
    out.feasible.push_back(std::move(cand));
  }
  rank_fastest(out.feasible);
}

}  // namespace

namespace {

// Whether some plan fits `world` ranks: the search over the keys the config leaves open, with
// those that only trade memory for time (micro-batch size, recompute, state placement, the
// exchange budget) held at their most frugal values, so that it stays fast.
bool some_plan_fits(const Config& base, const Machine& machine, int world) {
  Config c = base;
  auto frugal = [&](const char* key, auto set) {
    if (c.is_pinned(key)) return;
    set();
    c.pinned.insert(key);
  };
  frugal("train.micro_batch_size", [&] { c.train.micro_batch_size = 1; });
  frugal("train.recompute", [&] { c.train.recompute = true; });
  frugal("optim.state_placement", [&] { c.optim.state_placement = "auto"; });
  frugal("parallel.moe.exchange_budget", [&] { c.parallel.moe.exchange_budget = 2; });
  return !search_one_pipeline(c, machine, world).feasible.empty();
}

}  // namespace

FitAdvice fit_advice(const Config& cfg, int world, int gpus_per_node, bool batch,
                     const std::function<Machine(int)>& machine_for) {
  FitAdvice a;
  const int node = std::max(1, gpus_per_node);
  auto fits = [&](const Config& c, int w) {
    try {
      return some_plan_fits(c, machine_for(w), w);
    } catch (const UserError&) {
      return false;
    }
  };
  // Fewer ranks: the most that fit (a batch that divides over fewer, say).
  for (int w = world - 1; w >= 1 && !a.fewer; --w)
    if (w <= node || w % node == 0) a.fewer = fits(cfg, w) ? w : 0;
  // More: within a node, then whole nodes, up to kMaxNodes of them.
  constexpr int kMaxNodes = 64;
  for (int w = world + 1; w <= node * kMaxNodes && !a.more; ++w)
    if (w <= node || w % node == 0) a.more = fits(cfg, w) ? w : 0;
  // The global batch: the nearest sizes below and above that have a plan at `world`.
  constexpr int64_t kBatchSteps = 16;
  const int64_t gbs = cfg.train.global_batch_size;
  for (int64_t d = 1; batch && d <= kBatchSteps && (!a.batch_below || !a.batch_above); ++d) {
    for (int64_t b : {gbs - d, gbs + d}) {
      if (b < 1 || (b < gbs ? a.batch_below : a.batch_above)) continue;
      Config c = cfg;
      c.train.global_batch_size = b;
      if (!c.is_pinned("train.micro_batch_size") || b % c.train.micro_batch_size == 0)
        if (fits(c, world)) (b < gbs ? a.batch_below : a.batch_above) = b;
    }
  }
  return a;
}

}  // namespace mop
