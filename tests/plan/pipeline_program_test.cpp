// Pipeline stages in the step program and its walk: each rank's program runs its chunks' segments
// in the schedule's order between the messages its neighbours send (the program's messages, run
// through the symbolic check of plan/pipeline.h, meet and never wait forever); sliced weights
// never hold more gather slots than the program declares; the walk of the stages together gives
// the textbook 1F1B step (M + P − 1)·(f + b) on uniform stages, less with interleaving, and fails
// loudly when a message is missing; the plan prices a pipeline per stage (each parameter on one
// stage) and mop train refuses it.
#include <algorithm>
#include <map>
#include <set>
#include <tuple>
#include <string>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "core/error.h"
#include "plan/machine.h"
#include "plan/plan.h"
#include "plan/search.h"
#include "plan/step_walk.h"

using namespace mop;

namespace {

constexpr double kEps = 1e-12;

ProgramShape shape(int segments, int micro_batches) {
  ProgramShape s;
  s.segments = segments, s.micro_batches = micro_batches;
  s.host_segments.assign(size_t(segments), false);
  return s;
}

// Stage split of `segments` into `virtual_stages` as even as can be.
StageSplit even(int segments, int virtual_stages) {
  StageSplit s;
  for (int v = 0; v <= virtual_stages; ++v) s.first.push_back(v * segments / virtual_stages);
  return s;
}

std::vector<StepProgram> pipeline_programs(ProgramShape base, int ranks, int chunks, const std::string& schedule) {
  std::vector<StepProgram> out;
  for (int r = 0; r < ranks; ++r) {
    ProgramShape s = base;
    set_pipeline(s, even(s.segments, ranks * chunks), r, chunks, schedule);
    out.push_back(make_step_program(s));
  }
  return out;
}

// The program's sends and receives as the symbolic checker's ops (a pass between them).
std::vector<std::vector<PipeOp>> messages(const std::vector<StepProgram>& programs) {
  std::vector<std::vector<PipeOp>> ranks;
  const int P = int(programs.size());
  for (const StepProgram& p : programs) {
    std::vector<PipeOp> ops;
    const ProgramShape& s = p.shape;
    for (const Action& a : p.gradients) {
      int chunk = -1;
      for (size_t c = 0; c < s.chunks.size(); ++c)
        if (s.chunks[c].first == a.begin && s.chunks[c].second == a.end) chunk = int(c);
      const bool forward = a.kind == ActionKind::RecvActivation || a.kind == ActionKind::SendActivation;
      const PipePass pass{forward, a.micro_batch, chunk};
      switch (a.kind) {
        case ActionKind::RecvActivation:
          ops.push_back({PipeOp::Recv, pass, (s.stage + P - 1) % P});
          break;
        case ActionKind::RecvGrad:
          ops.push_back({PipeOp::Recv, pass, (s.stage + 1) % P});
          break;
        // A send names the pass that receives it (the neighbouring virtual stage's).
        case ActionKind::SendActivation:
          ops.push_back({PipeOp::Send, {true, a.micro_batch, (chunk * P + s.stage + 1) / P}, (s.stage + 1) % P});
          break;
        case ActionKind::SendGrad:
          ops.push_back({PipeOp::Send, {false, a.micro_batch, (chunk * P + s.stage - 1) / P}, (s.stage + P - 1) % P});
          break;
        default:
          break;
      }
    }
    ranks.push_back(ops);
  }
  return ranks;
}

// One segment per virtual stage: each costs f forward and b backward, nothing else.
std::vector<WalkCosts> uniform(const std::vector<StepProgram>& programs, double f, double b, double message) {
  std::vector<WalkCosts> costs;
  for (const StepProgram& p : programs) {
    WalkCosts c;
    c.forward.assign(size_t(p.shape.segments), f), c.backward.assign(size_t(p.shape.segments), b);
    c.message = message;
    costs.push_back(c);
  }
  return costs;
}

}  // namespace

TEST_CASE("pipeline program: each rank runs its chunks' segments in the schedule's order",
          "[cpu][plan]") {
  for (const auto& [ranks, chunks, M] : {std::tuple{2, 1, 4}, {4, 1, 3}, {2, 2, 4}, {4, 2, 8}}) {
    const std::string schedule = chunks > 1 ? "interleaved" : "1f1b";
    INFO(ranks << " ranks, " << chunks << " chunks, " << M << " micro-batches");
    const int S = ranks * chunks * 2;
    const std::vector<StepProgram> programs = pipeline_programs(shape(S, M), ranks, chunks, schedule);
    std::vector<int> runs(size_t(S), 0);
    for (const StepProgram& p : programs) {
      const ProgramShape& s = p.shape;
      const std::vector<PipePass> order =
          chunks > 1 ? interleaved(s.stage, ranks, M, chunks) : one_f_one_b(s.stage, ranks, M);
      CHECK(s.passes == order);
      // The passes' segments: every forward of the chunk in order, every backward in reverse.
      std::vector<Action> compute;
      for (const Action& a : p.gradients)
        if (a.kind == ActionKind::Forward || a.kind == ActionKind::Backward) compute.push_back(a);
      size_t i = 0;
      for (const PipePass& x : order) {
        const auto [first, end] = s.chunks[size_t(x.chunk)];
        for (int k = 0; k < end - first; ++k, ++i) {
          REQUIRE(i < compute.size());
          CHECK(compute[i].kind == (x.forward ? ActionKind::Forward : ActionKind::Backward));
          CHECK(compute[i].begin == (x.forward ? first + k : end - 1 - k));
          CHECK(compute[i].micro_batch == x.micro_batch);
        }
      }
      CHECK(i == compute.size());
      for (int seg = 0; seg < S; ++seg) runs[size_t(seg)] += s.runs(seg);
    }
    // Every segment on exactly one rank; the messages meet and nobody waits forever.
    CHECK(std::count(runs.begin(), runs.end(), 1) == S);
    CHECK(check_pipeline(messages(programs)) == "");
  }
}

TEST_CASE("pipeline program: sliced weights stay within the declared slots", "[cpu][plan]") {
  for (const int M : {1, 4}) {
    ProgramShape base = shape(12, M);
    base.sliced = true, base.pool_grads = M == 1, base.reduce = true;
    for (const StepProgram& p : pipeline_programs(base, 3, 1, "1f1b")) {
      INFO("rank " << p.shape.stage << ", " << M << " micro-batches");
      std::set<int> bound;
      size_t most = 0;
      for (const Action& a : p.gradients) {
        if (a.kind == ActionKind::Gather) bound.insert(a.begin);
        if (a.kind == ActionKind::Release) bound.erase(a.begin);
        most = std::max(most, bound.size());
        if (a.kind == ActionKind::Forward || a.kind == ActionKind::Backward) {
          CHECK(p.shape.runs(a.begin));
          CHECK(bound.count(a.begin) == 1);  // its weights are there
        }
        if (a.kind == ActionKind::Gather) CHECK(p.shape.runs(a.begin));
      }
      CHECK(most <= size_t(p.slots.shared_weights));
      CHECK(bound.empty());
    }
  }
}

TEST_CASE("pipeline walk: uniform 1F1B stages take (M + P − 1)·(f + b), interleaving less",
          "[cpu][plan]") {
  for (const auto& [P, M] : {std::pair{2, 4}, {4, 4}, {4, 8}, {3, 5}}) {
    INFO(P << " stages, " << M << " micro-batches");
    const std::vector<StepProgram> programs = pipeline_programs(shape(P, M), P, 1, "1f1b");
    const std::vector<WalkResult> r = walk_pipeline(programs, uniform(programs, 1, 2, 0));
    for (const WalkResult& w : r) CHECK(w.step == Approx((M + P - 1) * 3.0).epsilon(kEps));
    // The first stage waits for no activation: its bubble is all in the backward phase.
    CHECK(r[0].pipeline + r[0].losses_wait == Approx((P - 1) * 3.0).epsilon(kEps));
    // A message of 0.25 s on each hop: the first micro-batch's forward and backward alone cross
    // 2 (P − 1) of them; every send is on the pipe stream.
    const std::vector<WalkResult> slow = walk_pipeline(programs, uniform(programs, 1, 2, 0.25));
    CHECK(slow[0].step >= (M + P - 1) * 3.0 + 2 * (P - 1) * 0.25 - kEps);
    CHECK(slow[0].messages_total == Approx(M * 0.25).epsilon(kEps));
    CHECK(slow[1].messages_total == Approx((P > 2 ? 2 : 1) * M * 0.25).epsilon(kEps));
  }
  // The same work in two chunks per rank (each half as long): a smaller bubble.
  const int P = 4, M = 8;
  const std::vector<StepProgram> one = pipeline_programs(shape(P, M), P, 1, "1f1b");
  const std::vector<StepProgram> two = pipeline_programs(shape(2 * P, M), P, 2, "interleaved");
  const double t1 = walk_pipeline(one, uniform(one, 1, 2, 0))[0].step;
  const double t2 = walk_pipeline(two, uniform(two, 0.5, 1, 0))[0].step;
  CHECK(t1 == Approx(33).epsilon(kEps));
  CHECK(t2 < t1);
  CHECK(t2 >= M * 3.0);
}

TEST_CASE("pipeline walk: one rank is the plain walk; a missing message fails loudly", "[cpu][plan]") {
  const StepProgram plain = make_step_program(shape(5, 3));
  WalkCosts c;
  c.forward.assign(5, 1), c.backward.assign(5, 2), c.optimizer = 0.5;
  CHECK(walk_pipeline({plain}, {c})[0].step == walk_step(plain, c).step);
  std::vector<StepProgram> programs = pipeline_programs(shape(4, 4), 2, 1, "1f1b");
  auto& acts = programs[0].gradients;
  for (size_t i = 0; i < acts.size(); ++i)
    if (acts[i].kind == ActionKind::SendActivation && acts[i].micro_batch == 2) {
      acts.erase(acts.begin() + std::ptrdiff_t(i));
      break;
    }
  CHECK_THROWS_WITH(walk_pipeline(programs, uniform(programs, 1, 2, 0)),
                    Catch::Matchers::Contains("wait for each other forever"));
}

TEST_CASE("pipeline plan: every parameter on one stage, stages balanced", "[cpu][plan]") {
  auto config = [](const std::vector<std::string>& extra) {
    std::vector<std::string> sets = {"model.tie_embeddings=false"};
    sets.insert(sets.end(), extra.begin(), extra.end());
    return load_config(std::string(MOP_SOURCE_DIR) + "/configs/tiny.yaml", sets);
  };
  const Plan one = make_plan(config({"parallel.attention.dp=2", "parallel.moe.dp=2"}), builtin_machine("cpu"), 2);
  const Plan two = make_plan(config({"parallel.pp=2"}), builtin_machine("cpu"), 2);
  REQUIRE(two.pp == 2);
  REQUIRE(two.split.stages() == 2);
  CHECK(two.split.first.front() == 0);
  CHECK(two.split.first.back() == num_segments(two.dims));
  CHECK(two.split.first[1] > 0);
  CHECK(two.split.first[1] < num_segments(two.dims));
  // Stage 0's weights and stage 1's add up to the whole model's.
  const MemoryPlan a = two.memory_of_rank(0), b = two.memory_of_rank(1), whole = one.memory_of_rank(0);
  CHECK(a.weights + b.weights == whole.weights);
  CHECK(a.weights > 0);
  CHECK(b.weights > 0);
  CHECK(two.time.step > 0);
  CHECK(two.time.pipeline_bubble > 0);
  // The config's checks: a pipeline needs untied embeddings, virtual stages the interleaved
  // schedule, and stages that divide the ranks.
  CHECK_THROWS_AS(make_plan(config({"parallel.pp=2", "model.tie_embeddings=true"}), builtin_machine("cpu"), 2),
                  UserError);
  CHECK_THROWS_AS(make_plan(config({"parallel.pp=2", "parallel.pipeline.virtual_stages=2"}),
                            builtin_machine("cpu"), 2),
                  UserError);
  CHECK_THROWS_AS(make_plan(config({"parallel.pp=3"}), builtin_machine("cpu"), 2), UserError);
}

TEST_CASE("pipeline search: mop plan --search tries stages; the layouts mop train takes keep pp 1",
          "[cpu][plan]") {
  Config cfg = load_config(std::string(MOP_SOURCE_DIR) + "/configs/tiny.yaml", {"model.tie_embeddings=false"});
  const SearchResult with = search_plans(cfg, builtin_machine("cpu"), 2, /*pipelines=*/true);
  const SearchResult without = search_plans(cfg, builtin_machine("cpu"), 2);
  int piped = 0;
  for (const Candidate& c : with.feasible) {
    if (c.plan.pp == 1) continue;
    ++piped;
    CHECK(c.settings.rfind("pp 2", 0) == 0);
    CHECK(c.cfg.parallel.pp == 2);
  }
  CHECK(piped > 0);
  for (const Candidate& c : without.feasible) CHECK(c.plan.pp == 1);
  CHECK(std::find(with.open_keys.begin(), with.open_keys.end(), "parallel.pp") != with.open_keys.end());
  CHECK(std::find(without.open_keys.begin(), without.open_keys.end(), "parallel.pp") == without.open_keys.end());
  // The fastest interleaved plans are tried again over 3 and 4 chunks per rank (10 segments: pp 2
  // takes up to 5), with the same settings otherwise.
  cfg = load_config(std::string(MOP_SOURCE_DIR) + "/configs/tiny.yaml",
                    {"model.tie_embeddings=false", "model.num_layers=8", "train.global_batch_size=8",
                     "train.micro_batch_size=1"});
  const SearchResult deeper = search_plans(cfg, builtin_machine("cpu"), 2, /*pipelines=*/true);
  std::set<int64_t> chunks;
  for (const Candidate& c : deeper.feasible) {
    if (c.cfg.parallel.pipeline.schedule != "interleaved") continue;
    const int64_t v = c.cfg.parallel.pipeline.virtual_stages;
    chunks.insert(v);
    CHECK(c.plan.pp_chunks == v);
    CHECK(c.settings.rfind("pp 2 interleaved × " + std::to_string(v) + ", ", 0) == 0);
  }
  CHECK(chunks == std::set<int64_t>{2, 3, 4});
}
