// Pipeline stages: the split against every split of small cases; 1F1B and interleaved orders (each
// micro-batch's forward and backward once per virtual stage, in order, the micro-batches in flight
// bounded); and the symbolic check of every rank's sends and receives — clean over a grid of
// ranks, micro-batches and virtual stages, and failing for every deleted send or receive, for
// messages out of order and for a circular wait (mutation-tested).
#include <algorithm>
#include <functional>
#include <set>
#include <vector>

#include "catch.h"
#include "core/rng.h"
#include "plan/pipeline.h"

using namespace mop;

namespace {

// The slowest stage's time of the best split found by trying every one (feasible by `fits`).
double brute_force(const std::vector<double>& time, int stages,
                   const std::function<bool(int, int, int)>& fits) {
  const int S = int(time.size());
  double best = -1;
  std::vector<int> cut(size_t(stages + 1), 0);
  cut[size_t(stages)] = S;
  std::function<void(int)> place = [&](int k) {  // cut[k] for k = 1 .. stages − 1
    if (k == stages) {
      double worst = 0;
      for (int i = 0; i < stages; ++i) {
        if (!fits(i, cut[size_t(i)], cut[size_t(i + 1)])) return;
        double t = 0;
        for (int s = cut[size_t(i)]; s < cut[size_t(i + 1)]; ++s) t += time[size_t(s)];
        worst = std::max(worst, t);
      }
      if (best < 0 || worst < best) best = worst;
      return;
    }
    for (int c = cut[size_t(k - 1)] + 1; c <= S - (stages - k); ++c)
      cut[size_t(k)] = c, place(k + 1);
  };
  place(1);
  return best;
}

double slowest(const std::vector<double>& time, const StageSplit& split) {
  double worst = 0;
  for (int i = 0; i < split.stages(); ++i) {
    double t = 0;
    for (int s = split.first[size_t(i)]; s < split.first[size_t(i + 1)]; ++s) t += time[size_t(s)];
    worst = std::max(worst, t);
  }
  return worst;
}

std::vector<std::vector<PipeOp>> schedule(int ranks, int micro_batches, int chunks) {
  std::vector<std::vector<PipePass>> passes;
  for (int r = 0; r < ranks; ++r) passes.push_back(interleaved(r, ranks, micro_batches, chunks));
  return pipeline_messages(passes, chunks);
}

}  // namespace

TEST_CASE("pipeline: the stage split is the best of every split", "[cpu][plan]") {
  const auto any = [](int, int, int) { return true; };
  // Even segments split evenly; one heavy segment gets a stage of its own.
  const std::vector<double> even(8, 1.0);
  CHECK(split_stages(even, 4, any)->first == std::vector<int>{0, 2, 4, 6, 8});
  const std::vector<double> heavy = {1, 1, 1, 1, 10, 1, 1, 1};
  const StageSplit h = *split_stages(heavy, 3, any);
  CHECK(slowest(heavy, h) == 10);
  CHECK(h.stage_of(4) == 1);
  CHECK(h.first == std::vector<int>{0, 4, 5, 8});  // the earlier stages short, the last one long
  CHECK(!split_stages(even, 9, any));
  // A memory cap of three segments a stage, the first stage (most micro-batches in flight) two.
  const auto capped = [](int stage, int first, int end) {
    return end - first <= (stage == 0 ? 2 : 3);
  };
  CHECK(!split_stages(even, 2, capped));
  CHECK(split_stages(even, 3, capped)->first == std::vector<int>{0, 2, 5, 8});
  // Random times and caps against every split.
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const int S = 2 + int(philox_u64(seed, 1, 0) % 7),
              P = 1 + int(philox_u64(seed, 2, 0) % std::min(S, 4));
    std::vector<double> t;
    for (int s = 0; s < S; ++s) t.push_back(double(1 + philox_u64(seed, 3, uint64_t(s)) % 9));
    const int cap = 1 + int(philox_u64(seed, 4, 0) % S);
    const auto fits = [&](int, int first, int end) { return end - first <= cap; };
    INFO("seed " << seed << " segments " << S << " stages " << P << " cap " << cap);
    const double want = brute_force(t, P, fits);
    const std::optional<StageSplit> got = split_stages(t, P, fits);
    CHECK(got.has_value() == (want >= 0));
    if (got) {
      CHECK(slowest(t, *got) == want);
      for (int i = 0; i < P; ++i) CHECK(fits(i, got->first[size_t(i)], got->first[size_t(i + 1)]));
    }
  }
}

// The busiest rank's time when rank r runs virtual stages r, r + ranks, ...
double busiest(const std::vector<double>& time, const StageSplit& split, int ranks) {
  std::vector<double> rank(size_t(ranks), 0);
  for (int i = 0; i < split.stages(); ++i)
    for (int s = split.first[size_t(i)]; s < split.first[size_t(i + 1)]; ++s)
      rank[size_t(i % ranks)] += time[size_t(s)];
  return *std::max_element(rank.begin(), rank.end());
}

TEST_CASE("pipeline: interleaved stages balance each rank's chunks together", "[cpu][plan]") {
  const auto any = [](int, int, int) { return true; };
  // moe-1t's 106 segments (embedding, 104 layers, LM head) in equal times: the virtual stages'
  // best split puts 5 + 5 on a rank; balanced per rank, none holds more than ⌈106 / 12⌉ = 9.
  for (int chunks : {2, 3, 4}) {
    INFO("chunks " << chunks);
    const std::vector<double> t(106, 1.0);
    const StageSplit v = *split_stages(t, 12 * chunks, any);
    const StageSplit b = balance_ranks(t, v, 12);
    CHECK(busiest(t, b, 12) == 9);
    CHECK(busiest(t, v, 12) >= busiest(t, b, 12));
  }
  CHECK(busiest(std::vector<double>(106, 1.0), *split_stages(std::vector<double>(106, 1.0), 24, any), 12) == 10);
  // Random times: never busier than the split it starts from, every stage one segment or more,
  // and with one stage per rank the split itself.
  for (uint64_t seed = 0; seed < 200; ++seed) {
    const int P = 1 + int(philox_u64(seed, 1, 0) % 4), chunks = 1 + int(philox_u64(seed, 2, 0) % 3);
    const int S = P * chunks + int(philox_u64(seed, 3, 0) % 12);
    std::vector<double> t;
    for (int s = 0; s < S; ++s) t.push_back(double(1 + philox_u64(seed, 4, uint64_t(s)) % 9));
    INFO("seed " << seed << " segments " << S << " ranks " << P << " chunks " << chunks);
    const StageSplit v = *split_stages(t, P * chunks, any);
    const StageSplit b = balance_ranks(t, v, P);
    CHECK(busiest(t, b, P) <= busiest(t, v, P));
    REQUIRE(b.stages() == P * chunks);
    CHECK(b.first.front() == 0);
    CHECK(b.first.back() == S);
    for (int i = 0; i < b.stages(); ++i) CHECK(b.first[size_t(i + 1)] > b.first[size_t(i)]);
    if (chunks == 1) CHECK(b.first == v.first);
  }
}

TEST_CASE("pipeline: 1F1B and interleaved run each pass once, in order, a bounded number in flight",
          "[cpu][plan]") {
  for (int P : {1, 2, 3, 4})
    for (int chunks : {1, 2, 3})
      for (int M : {1, 2, 3, 4, 6, 8, 12}) {
        if (chunks > 1 && M % P != 0) continue;
        for (int r = 0; r < P; ++r) {
          INFO("ranks " << P << " rank " << r << " micro-batches " << M << " chunks " << chunks);
          const std::vector<PipePass> order = interleaved(r, P, M, chunks);
          CHECK(int(order.size()) == 2 * M * chunks);
          std::set<std::pair<int, int>> done_fwd, done_bwd;
          int in_flight = 0, most = 0;
          for (const PipePass& p : order) {
            const std::pair<int, int> key{p.micro_batch, p.chunk};
            if (p.forward) {
              CHECK(done_fwd.insert(key).second);
              most = std::max(most, ++in_flight);
            } else {
              CHECK(done_fwd.count(key));  // a pass's backward after its forward
              CHECK(done_bwd.insert(key).second);
              --in_flight;
            }
          }
          CHECK(int(done_bwd.size()) == M * chunks);
          // 1F1B keeps at most the stages from here to the last in flight: the first the most.
          if (chunks == 1) CHECK(most == std::min(M, P - r));
        }
      }
  CHECK_THROWS(interleaved(0, 2, 3, 2));  // micro-batches not a multiple of the ranks
}

TEST_CASE("pipeline: every send meets its receive, and no rank waits forever", "[cpu][plan]") {
  for (int P : {1, 2, 3, 4})
    for (int chunks : {1, 2})
      for (int M : {1, 2, 3, 4, 8}) {
        if (chunks > 1 && M % P != 0) continue;
        INFO("ranks " << P << " micro-batches " << M << " chunks " << chunks);
        const auto ops = schedule(P, M, chunks);
        CHECK(check_pipeline(ops) == "");
        // Messages: each virtual stage boundary carries M activations and M gradients.
        int sends = 0;
        for (const auto& rank : ops)
          for (const PipeOp& op : rank) sends += op.kind == PipeOp::Send;
        CHECK(sends == 2 * M * (P * chunks - 1));
      }
}

TEST_CASE("pipeline: the check catches every deleted message, a swap and a circular wait",
          "[cpu][plan]") {
  for (const auto [P, M, chunks] :
       {std::tuple{2, 3, 1}, std::tuple{4, 8, 1}, std::tuple{2, 4, 2}, std::tuple{3, 6, 2}}) {
    INFO("ranks " << P << " micro-batches " << M << " chunks " << chunks);
    const auto ops = schedule(P, M, chunks);
    REQUIRE(check_pipeline(ops) == "");
    int mutants = 0;
    for (int r = 0; r < P; ++r)
      for (size_t i = 0; i < ops[size_t(r)].size(); ++i) {
        if (ops[size_t(r)][i].kind == PipeOp::Pass) continue;
        auto mutant = ops;
        mutant[size_t(r)].erase(mutant[size_t(r)].begin() + long(i));
        INFO("without rank " << r << "'s " << describe(ops[size_t(r)][i]));
        CHECK(check_pipeline(mutant) != "");
        ++mutants;
      }
    CHECK(mutants > 0);
    // The first rank sends micro-batches 0 and 1 the other way round: the next rank finds them out
    // of order.
    auto swapped = ops;
    auto& first = swapped[0];
    std::vector<size_t> sends;
    for (size_t i = 0; i < first.size(); ++i)
      if (first[i].kind == PipeOp::Send && first[i].pass.forward && first[i].pass.chunk == 0)
        sends.push_back(i);
    REQUIRE(sends.size() >= 2);
    std::swap(first[sends[0]], first[sends[1]]);
    CHECK(check_pipeline(swapped).find("first on the link") != std::string::npos);
    // The last rank runs its passes backwards: messages come out of order.
    auto reversed = ops;
    std::reverse(reversed.back().begin(), reversed.back().end());
    CHECK(check_pipeline(reversed) != "");
    // The first rank waits for its first gradient before it sends any activation, which the rank
    // after it waits for: a circular wait.
    auto circular = ops;
    auto& zero = circular[0];
    const auto grad = std::find_if(zero.begin(), zero.end(), [](const PipeOp& op) {
      return op.kind == PipeOp::Recv && !op.pass.forward;
    });
    REQUIRE(grad != zero.end());
    const PipeOp wait = *grad;
    zero.erase(grad);
    zero.insert(zero.begin(), wait);
    CHECK(check_pipeline(circular).find("waits forever") != std::string::npos);
  }
}
