// Pipeline stages, pass orders and their symbolic check (see pipeline.h).
#include "plan/pipeline.h"

#include <algorithm>
#include <cmath>
#include <deque>
#include <limits>
#include <map>

#include "core/error.h"

namespace mop {

int StageSplit::stage_of(int segment) const {
  for (int i = 0; i < stages(); ++i)
    if (segment >= first[size_t(i)] && segment < first[size_t(i + 1)]) return i;
  MOP_CHECK(false, "segment ", segment, " outside the stages' ", first.back(), " segments");
  return -1;
}

std::optional<StageSplit> split_stages(
    const std::vector<double>& time, int stages,
    const std::function<bool(int stage, int first, int end)>& fits) {
  const int S = int(time.size());
  MOP_CHECK(stages >= 1, "pipeline stages: ", stages);
  if (stages > S) return std::nullopt;
  std::vector<double> prefix(size_t(S + 1), 0);
  for (int s = 0; s < S; ++s) prefix[size_t(s + 1)] = prefix[size_t(s)] + time[size_t(s)];
  const double inf = std::numeric_limits<double>::infinity();
  // best[k][j]: the slowest stage's time, at best, of the first j segments in k stages.
  std::vector<std::vector<double>> best(size_t(stages + 1),
                                        std::vector<double>(size_t(S + 1), inf));
  best[0][0] = 0;
  for (int k = 1; k <= stages; ++k)
    for (int j = k; j <= S; ++j)
      for (int i = k - 1; i < j; ++i) {
        if (best[size_t(k - 1)][size_t(i)] == inf || !fits(k - 1, i, j)) continue;
        best[size_t(k)][size_t(j)] = std::min(
            best[size_t(k)][size_t(j)],
            std::max(best[size_t(k - 1)][size_t(i)], prefix[size_t(j)] - prefix[size_t(i)]));
      }
  const double target = best[size_t(stages)][size_t(S)];
  if (target == inf) return std::nullopt;
  // Back from the last stage, each as long as the optimum allows: the earlier stages shortest.
  StageSplit split;
  split.first.assign(size_t(stages + 1), 0);
  split.first[size_t(stages)] = S;
  for (int k = stages, j = S; k >= 1; --k) {
    int start = -1;
    for (int i = k - 1; i < j && start < 0; ++i)
      if (best[size_t(k - 1)][size_t(i)] <= target &&
          prefix[size_t(j)] - prefix[size_t(i)] <= target && fits(k - 1, i, j))
        start = i;
    MOP_CHECK(start >= 0, "pipeline split: no start for stage ", k - 1);
    split.first[size_t(k - 1)] = start, j = start;
  }
  return split;
}

namespace {
// What balance_ranks lowers, in order: the busiest rank's time, how many ranks are that busy (to a
// relative 1e-9), the slowest virtual stage.
struct RankLoad {
  double busiest = 0, slowest = 0;
  int at_busiest = 0;
  bool operator<(const RankLoad& o) const {
    const double eps = 1e-9 * std::max(busiest, o.busiest);
    if (busiest < o.busiest - eps || busiest > o.busiest + eps) return busiest < o.busiest;
    if (at_busiest != o.at_busiest) return at_busiest < o.at_busiest;
    return slowest < o.slowest - 1e-9 * std::max(slowest, o.slowest);
  }
};

RankLoad rank_load(const std::vector<double>& prefix, const StageSplit& split, int ranks) {
  std::vector<double> rank(size_t(ranks), 0);
  RankLoad load;
  for (int v = 0; v < split.stages(); ++v) {
    const double t = prefix[size_t(split.first[size_t(v + 1)])] - prefix[size_t(split.first[size_t(v)])];
    rank[size_t(v % ranks)] += t, load.slowest = std::max(load.slowest, t);
  }
  load.busiest = *std::max_element(rank.begin(), rank.end());
  for (double t : rank) load.at_busiest += t >= load.busiest * (1 - 1e-9);
  return load;
}
}  // namespace

StageSplit balance_ranks(const std::vector<double>& time, StageSplit split, int ranks) {
  const int V = split.stages();
  MOP_CHECK(ranks >= 1 && V % ranks == 0, "pipeline: ", V, " virtual stages over ", ranks, " ranks");
  if (V == ranks) return split;  // one stage per rank: the split's own balance
  std::vector<double> prefix(time.size() + 1, 0);
  for (size_t s = 0; s < time.size(); ++s) prefix[s + 1] = prefix[s] + time[s];
  RankLoad now = rank_load(prefix, split, ranks);
  // Each round takes the best move: one segment from stage a to stage b, every boundary between
  // them shifting by one (the stages in between keep their number of segments). Each lowers the
  // load; the rounds are bounded all the same (the comparison's tolerance is not transitive).
  for (size_t round = 0; round < time.size() * size_t(V); ++round) {
    StageSplit best = split;
    RankLoad best_load = now;
    for (int a = 0; a < V; ++a) {
      if (split.first[size_t(a + 1)] - split.first[size_t(a)] < 2) continue;
      for (int b = 0; b < V; ++b) {
        if (b == a) continue;
        StageSplit next = split;
        if (a < b)
          for (int i = a + 1; i <= b; ++i) --next.first[size_t(i)];
        else
          for (int i = b + 1; i <= a; ++i) ++next.first[size_t(i)];
        const RankLoad load = rank_load(prefix, next, ranks);
        if (load < best_load) best = std::move(next), best_load = load;
      }
    }
    if (!(best_load < now)) break;
    split = std::move(best), now = best_load;
  }
  return split;
}

std::vector<PipePass> one_f_one_b(int rank, int ranks, int micro_batches) {
  MOP_CHECK(ranks >= 1 && rank >= 0 && rank < ranks && micro_batches >= 1, "1F1B: rank ", rank,
            " of ", ranks, ", ", micro_batches, " micro-batches");
  const int warmup = std::min(ranks - rank - 1, micro_batches);
  std::vector<PipePass> out;
  for (int m = 0; m < warmup; ++m) out.push_back({true, m, 0});
  for (int i = 0; i < micro_batches - warmup; ++i) {
    out.push_back({true, warmup + i, 0});
    out.push_back({false, i, 0});
  }
  for (int m = micro_batches - warmup; m < micro_batches; ++m) out.push_back({false, m, 0});
  return out;
}

std::vector<PipePass> interleaved(int rank, int ranks, int micro_batches, int chunks) {
  MOP_CHECK(chunks >= 1, "interleaved pipeline: ", chunks, " virtual stages per rank");
  if (chunks == 1) return one_f_one_b(rank, ranks, micro_batches);
  MOP_CHECK(micro_batches % ranks == 0, "interleaved pipeline: ", micro_batches,
            " micro-batches are not a multiple of the ", ranks, " pipeline ranks");
  const int total = micro_batches * chunks, group = ranks * chunks;
  // The k-th forward (backward) of this rank: micro-batches in groups of `ranks`, chunk by chunk
  // (backwards from the last chunk).
  auto pass = [&](int k, bool forward) {
    const int in_group = (k % group) / ranks;
    return PipePass{forward, (k / group) * ranks + k % ranks,
                    forward ? in_group : chunks - 1 - in_group};
  };
  // Warm-up: enough forwards that every later virtual stage has work when this rank's first
  // backward comes back (all of them when there are as many micro-batches as ranks).
  const int warmup = micro_batches == ranks
                         ? total
                         : std::min(total, (ranks - rank - 1) * 2 + (chunks - 1) * ranks);
  std::vector<PipePass> out;
  for (int k = 0; k < warmup; ++k) out.push_back(pass(k, true));
  for (int k = 0; k < total - warmup; ++k) {
    out.push_back(pass(warmup + k, true));
    out.push_back(pass(k, false));
  }
  for (int k = total - warmup; k < total; ++k) out.push_back(pass(k, false));
  return out;
}

std::string describe(const PipeOp& op) {
  const std::string pass = std::string(op.pass.forward ? "forward" : "backward") + " mb " +
                           std::to_string(op.pass.micro_batch) + " chunk " +
                           std::to_string(op.pass.chunk);
  switch (op.kind) {
    case PipeOp::Pass:
      return pass;
    case PipeOp::Send:
      return "send to " + std::to_string(op.peer) + " (" + pass + ")";
    case PipeOp::Recv:
      return "receive from " + std::to_string(op.peer) + " (" + pass + ")";
  }
  return "?";
}

std::vector<std::vector<PipeOp>> pipeline_messages(const std::vector<std::vector<PipePass>>& passes,
                                                   int chunks) {
  const int P = int(passes.size()), V = P * chunks;
  std::vector<std::vector<PipeOp>> out(static_cast<size_t>(P));
  for (int r = 0; r < P; ++r)
    for (const PipePass& p : passes[size_t(r)]) {
      const int v = p.chunk * P + r;  // this pass's virtual stage
      auto peer_pass = [&](int w) { return PipePass{p.forward, p.micro_batch, w / P}; };
      std::vector<PipeOp>& ops = out[size_t(r)];
      if (p.forward && v > 0) ops.push_back({PipeOp::Recv, p, (v - 1) % P});
      if (!p.forward && v < V - 1) ops.push_back({PipeOp::Recv, p, (v + 1) % P});
      ops.push_back({PipeOp::Pass, p, -1});
      if (p.forward && v < V - 1) ops.push_back({PipeOp::Send, peer_pass(v + 1), (v + 1) % P});
      if (!p.forward && v > 0) ops.push_back({PipeOp::Send, peer_pass(v - 1), (v - 1) % P});
    }
  return out;
}

std::string check_pipeline(const std::vector<std::vector<PipeOp>>& ranks) {
  const int P = int(ranks.size());
  std::vector<size_t> at(size_t(P), 0);
  std::map<std::pair<int, int>, std::deque<PipePass>> links;  // (from, to) → messages in order
  for (bool progress = true; progress;) {
    progress = false;
    for (int r = 0; r < P; ++r)
      while (at[size_t(r)] < ranks[size_t(r)].size()) {
        const PipeOp& op = ranks[size_t(r)][at[size_t(r)]];
        if (op.peer >= P || (op.kind != PipeOp::Pass && op.peer < 0))
          return "rank " + std::to_string(r) + ": " + describe(op) + " names no pipeline rank";
        if (op.kind == PipeOp::Send) links[{r, op.peer}].push_back(op.pass);
        if (op.kind == PipeOp::Recv) {
          std::deque<PipePass>& link = links[{op.peer, r}];
          if (link.empty()) break;  // waits
          if (!(link.front() == op.pass))
            return "rank " + std::to_string(r) + ": " + describe(op) + " finds " +
                   describe(PipeOp{PipeOp::Pass, link.front(), -1}) + " first on the link";
          link.pop_front();
        }
        ++at[size_t(r)], progress = true;
      }
  }
  std::string stuck;
  for (int r = 0; r < P; ++r)
    if (at[size_t(r)] < ranks[size_t(r)].size())
      stuck += (stuck.empty() ? "" : "; ") + ("rank " + std::to_string(r) + " waits forever at " +
                                              describe(ranks[size_t(r)][at[size_t(r)]]));
  if (!stuck.empty()) return stuck;
  for (const auto& [link, messages] : links)
    if (!messages.empty())
      return "rank " + std::to_string(link.first) + "'s send to " + std::to_string(link.second) +
             " (" + describe(PipeOp{PipeOp::Pass, messages.front(), -1}) + ") is never received";
  return "";
}

}  // namespace mop
