// The step program the plan makes for configs/tiny.yaml (4 layers: 6 segments), for several
// layouts, against the action lists written out by hand: one rank with the overlapped device
// update or without it, host-held state, two GPU ranks summing gradients on their own stream, and
// ZeRO-1 owners whose programs differ by rank. Also `describe` and the JSON form.
#include <set>
#include <string>
#include <vector>

#include "catch.h"
#include "config/config.h"
#include "model/params.h"
#include "plan/program.h"
#include "plan/report.h"

using namespace mop;

namespace {

Plan tiny_plan(const std::vector<std::string>& overrides, int world) {
  const Config cfg = load_config(std::string(MOP_SOURCE_DIR) + "/configs/tiny.yaml", overrides);
  const std::string device = cfg.train.device == "cuda" ? "h200" : "cpu";
  return make_plan(cfg, builtin_machine(device), world);
}

// "name[ segment][ mMB][ (stream)]" per action, joined by " | "; the compute stream is left out.
std::string compact(const std::vector<Action>& actions) {
  std::string out;
  for (const Action& a : actions) {
    if (!out.empty()) out += " | ";
    out += action_name(a.kind);
    if (a.begin >= 0) {
      REQUIRE(a.end == a.begin + 1);
      out += " " + std::to_string(a.begin);
    }
    if (a.micro_batch >= 0) out += " m" + std::to_string(a.micro_batch);
    if (a.stream != StreamKind::Compute) out += std::string(" (") + stream_name(a.stream) + ")";
  }
  return out;
}

// The forward of micro-batch m: `before(s)` then "forward s mM" for segments 0..5, written out.
std::string forward(int m, const std::string& before) {
  std::string out = "begin-forward m" + std::to_string(m);
  for (int s = 0; s <= 5; ++s) {
    const std::string tail = " " + std::to_string(s) + " m" + std::to_string(m);
    if (!before.empty()) out += " | " + before + tail;
    out += " | forward" + tail;
  }
  return out;
}

}  // namespace

TEST_CASE("program: one CPU rank, two micro-batches, the device update overlapped", "[cpu][plan]") {
  const Plan plan = tiny_plan({}, 1);
  REQUIRE(plan.micro_batches == 2);
  const StepProgram p = make_step_program(plan, 0);
  CHECK(p.shape.segments == 6);
  CHECK(p.shape.device_update_overlapped);
  const std::string bwd0 = "begin-backward m0 | backward 5 m0 | backward 4 m0 | backward 3 m0 | "
                           "backward 2 m0 | backward 1 m0 | backward 0 m0";
  const std::string bwd1 = "begin-backward m1 | backward 5 m1 | backward 4 m1 | backward 3 m1 | "
                           "backward 2 m1 | backward 1 m1 | backward 0 m1";
  CHECK(compact(p.gradients) == "zero-grads | " + forward(0, "wait-update") + " | " + bwd0 + " | " +
                                    forward(1, "wait-update") + " | " + bwd1 + " | read-losses (host)");
  CHECK(compact(p.apply) ==
        "optimizer | device-update 0 (update) | device-update 1 (update) | device-update 2 (update) | "
        "device-update 3 (update) | device-update 4 (update) | device-update 5 (update)");
}

TEST_CASE("program: one rank, one micro-batch, updates in turn", "[cpu][plan]") {
  const Plan plan = tiny_plan({"optim.overlap=false", "train.global_batch_size=8"}, 1);
  const StepProgram p = make_step_program(plan, 0);
  CHECK(compact(p.gradients) ==
        "zero-grads | begin-forward m0 | forward 0 m0 | forward 1 m0 | forward 2 m0 | forward 3 m0 | "
        "forward 4 m0 | forward 5 m0 | begin-backward m0 | backward 5 m0 | backward 4 m0 | "
        "backward 3 m0 | backward 2 m0 | backward 1 m0 | backward 0 m0 | read-losses (host)");
  CHECK(compact(p.apply) == "optimizer");
}

TEST_CASE("program: host-held state waits for each segment's weights and sends its gradients",
          "[cpu][plan]") {
  const Plan plan = tiny_plan({"optim.state_placement=host", "train.global_batch_size=8"}, 1);
  const StepProgram p = make_step_program(plan, 0);
  CHECK(!p.shape.device_update_overlapped);
  CHECK(compact(p.gradients) ==
        "zero-grads | " + forward(0, "weights-ready") +
            " | begin-backward m0 | backward 5 m0 | grads-to-host 5 m0 (host-copy) | backward 4 m0 | "
            "grads-to-host 4 m0 (host-copy) | backward 3 m0 | grads-to-host 3 m0 (host-copy) | "
            "backward 2 m0 | grads-to-host 2 m0 (host-copy) | backward 1 m0 | "
            "grads-to-host 1 m0 (host-copy) | backward 0 m0 | grads-to-host 0 m0 (host-copy) | "
            "read-losses (host)");
  CHECK(compact(p.apply) == "optimizer | host-update (host-copy)");
}

TEST_CASE("program: two GPU ranks sum each segment's gradients on their own stream", "[cpu][plan]") {
  const Plan plan = tiny_plan({"train.device=cuda", "parallel.attention.dp=2", "parallel.moe.dp=2",
                               "parallel.zero=false", "optim.state_placement=gpu"},
                              2);
  REQUIRE(plan.micro_batches == 1);
  for (int rank : {0, 1}) {
    const StepProgram p = make_step_program(plan, rank);
    CHECK(compact(p.gradients) ==
          "zero-grads | " + forward(0, "wait-update") +
              " | begin-backward m0 | backward 5 m0 | reduce-grads 5 m0 (grad-sums) | backward 4 m0 | "
              "reduce-grads 4 m0 (grad-sums) | backward 3 m0 | reduce-grads 3 m0 (grad-sums) | "
              "backward 2 m0 | reduce-grads 2 m0 (grad-sums) | backward 1 m0 | "
              "reduce-grads 1 m0 (grad-sums) | backward 0 m0 | reduce-grads 0 m0 (grad-sums) | "
              "join-reduce | read-losses (host)");
    CHECK(p.apply.size() == 7);
  }
  // parallel.overlap_grad_reduce: false sums on the compute stream, in turn.
  const Plan serial = tiny_plan({"train.device=cuda", "parallel.attention.dp=2", "parallel.moe.dp=2",
                                 "parallel.zero=false", "parallel.overlap_grad_reduce=false"},
                                2);
  for (const Action& a : make_step_program(serial, 0).gradients) CHECK(a.stream != StreamKind::GradSums);
}

TEST_CASE("program: ZeRO-1 owners with host state: each rank sends the segments it owns",
          "[cpu][plan]") {
  const Plan plan = tiny_plan({"parallel.attention.dp=2", "parallel.moe.dp=2", "optim.state_placement=host",
                               "train.global_batch_size=16"},
                              2);
  REQUIRE(plan.parallel.zero1());
  std::set<int> sent_by_any;
  const ModelLayout layout = ModelLayout::build(plan.dims);
  for (int rank : {0, 1}) {
    const StepProgram p = make_step_program(plan, rank);
    std::set<int> sent;
    for (size_t i = 0; i < p.gradients.size(); ++i) {
      const Action& a = p.gradients[i];
      if (a.kind != ActionKind::GradsToHost) continue;
      sent.insert(a.begin);
      // Its sums first, joined: the host copies summed gradients.
      REQUIRE(i >= 3);
      CHECK(p.gradients[i - 1].kind == ActionKind::JoinReduce);
      CHECK(p.gradients[i - 2].kind == ActionKind::ReduceGrads);
      CHECK(p.gradients[i - 2].begin == a.begin);
      CHECK(p.gradients[i - 3].kind == ActionKind::Backward);
    }
    // Exactly the segments with a parameter this rank owns.
    std::set<int> owned;
    for (int q = 0; q < int(layout.params.size()); ++q)
      if (plan.owns(rank, q)) owned.insert(param_segment(layout, q));
    CHECK(sent == owned);
    sent_by_any.insert(sent.begin(), sent.end());
    CHECK(compact(p.apply) == "optimizer | host-update (host-copy) | broadcast");
  }
  CHECK(sent_by_any.size() == 6);
}

TEST_CASE("program: its text and JSON forms", "[cpu][plan]") {
  const Plan plan = tiny_plan({"train.global_batch_size=8", "optim.overlap=false"}, 1);
  const StepProgram p = make_step_program(plan, 0);
  const std::string text = program_text(p);
  CHECK(text.find("step program: 6 segments (embedding, 4 layers, head), 1 micro-batch(es)") == 0);
  CHECK(text.find("  forward         seg [2,3)    mb 0   compute\n") != std::string::npos);
  const Json j = program_json(p);
  const Json::Array& grads = j.at("gradients").as_array();
  REQUIRE(grads.size() == p.gradients.size());
  CHECK(grads[1].at("action").as_string() == "begin-forward");
  CHECK(grads[1].at("micro_batch").as_int64() == 0);
  CHECK(grads[2].at("segments") == Json(Json::Array{Json(0), Json(1)}));
  CHECK(j.at("apply").as_array()[0].at("action").as_string() == "optimizer");
}

TEST_CASE("program: sliced parameters gather, release and reduce-scatter each segment", "[cpu][plan]") {
  // One micro-batch: whole gradients only for the segments in flight.
  const Plan plan = tiny_plan({"parallel.shard=slice", "train.global_batch_size=8", "optim.overlap=false"}, 1);
  REQUIRE(plan.micro_batches == 1);
  REQUIRE(plan.parallel.sliced());
  const StepProgram p = make_step_program(plan, 0);
  CHECK(p.shape.pool_grads);
  CHECK(!p.shape.device_update_overlapped);
  // The gathers run one segment ahead on their stream; join-gathers before each segment that
  // needs one.
  CHECK(compact(p.gradients) ==
        "begin-forward m0 | gather 0 m0 (gathers) | join-gathers m0 | gather 1 m0 (gathers) | forward 0 m0 | "
        "release 0 m0 | join-gathers m0 | gather 2 m0 (gathers) | forward 1 m0 | release 1 m0 | join-gathers m0 | "
        "gather 3 m0 (gathers) | forward 2 m0 | release 2 m0 | join-gathers m0 | gather 4 m0 (gathers) | "
        "forward 3 m0 | release 3 m0 | join-gathers m0 | gather 5 m0 (gathers) | forward 4 m0 | join-gathers m0 | "
        "grad-slot 5 m0 | forward 5 m0 | begin-backward m0 | backward 5 m0 | release 5 m0 | reduce-scatter 5 m0 | "
        "gather 3 m0 (gathers) | grad-slot 4 m0 | backward 4 m0 | release 4 m0 | reduce-scatter 4 m0 | "
        "join-gathers m0 | gather 2 m0 (gathers) | grad-slot 3 m0 | backward 3 m0 | release 3 m0 | "
        "reduce-scatter 3 m0 | join-gathers m0 | gather 1 m0 (gathers) | grad-slot 2 m0 | backward 2 m0 | "
        "release 2 m0 | reduce-scatter 2 m0 | join-gathers m0 | gather 0 m0 (gathers) | grad-slot 1 m0 | "
        "backward 1 m0 | release 1 m0 | reduce-scatter 1 m0 | join-gathers m0 | grad-slot 0 m0 | backward 0 m0 | "
        "release 0 m0 | reduce-scatter 0 m0 | read-losses (host)");
  CHECK(compact(p.apply) == "optimizer");

  // With the overlapped device update each segment's slices are gathered once their update is
  // done: a wait-update right before every forward gather.
  const StepProgram o = make_step_program(tiny_plan({"parallel.shard=slice", "train.global_batch_size=8"}, 1), 0);
  CHECK(o.shape.device_update_overlapped);
  CHECK(compact(o.gradients).find("begin-forward m0 | wait-update 0 m0 | gather 0 m0 (gathers) | join-gathers m0 | "
                                  "wait-update 1 m0 | gather 1 m0 (gathers) | forward 0 m0 |") == 0);
  CHECK(compact(o.apply) == "optimizer | device-update 0 (update) | device-update 1 (update) | device-update 2 "
                            "(update) | device-update 3 (update) | device-update 4 (update) | device-update 5 (update)");

  // Every layout run against the parameter store's two slots: each forward and backward finds
  // its weights gathered (a tied embedding's too) and each backward its gradients' slot; every
  // gather group is reduce-scattered once, after its last backward.
  for (const bool tied : {false, true})
    for (const int mb : {1, 3})
      for (const bool host : {false, true}) {
        INFO("tied " << tied << " micro-batches " << mb << " host " << host);
        const Plan q = tiny_plan({"parallel.shard=slice", "train.global_batch_size=" + std::to_string(8 * mb),
                                  std::string("model.tie_embeddings=") + (tied ? "true" : "false"),
                                  std::string("optim.state_placement=") + (host ? "host" : "auto")},
                                 1);
        const ModelLayout layout = ModelLayout::build(q.dims);
        ParamSlices slices;
        slices.n.assign(layout.params.size(), 1), slices.index.assign(layout.params.size(), 0);
        slices.pool_grads = q.micro_batches == 1, slices.allocate = false;
        ParamStore store(layout, DType::F32, DType::F32, MemKind::Host, slices);
        const StepProgram sp = make_step_program(q, 0);
        const int S = sp.shape.segments, groups = store.num_gather_groups();
        CHECK(groups == S + (tied ? 1 : 0));
        std::vector<int> scattered(size_t(groups), 0), backward_done(size_t(S), 0);
        std::set<int> in_flight;  // gathers issued and not joined yet
        for (const Action& a : sp.gradients) {
          switch (a.kind) {
            case ActionKind::Gather:
              store.bind_weights(a.begin);  // throws with no free slot
              in_flight.insert(a.begin);
              break;
            case ActionKind::JoinGathers: in_flight.clear(); break;
            case ActionKind::Release: store.release_weights(a.begin); break;
            case ActionKind::GradSlot: store.bind_grads(a.begin); break;
            case ActionKind::ReduceScatter:
              CHECK(store.grads_bound(a.begin));
              store.release_grads(a.begin);
              ++scattered[size_t(a.begin)];
              break;
            case ActionKind::Forward:
            case ActionKind::Backward:
              CHECK(store.weights_bound(a.begin));
              CHECK(!in_flight.count(a.begin));
              if (tied && (a.begin == 0 || a.begin == S - 1)) CHECK(!in_flight.count(S));
              if (tied && (a.begin == 0 || a.begin == S - 1)) CHECK(store.weights_bound(S));
              if (a.kind == ActionKind::Backward || a.begin == S - 1) {
                CHECK(store.grads_bound(a.begin));
                if (tied && a.begin == S - 1) CHECK(store.grads_bound(S));
              }
              if (a.kind == ActionKind::Backward) ++backward_done[size_t(a.begin)];
              break;
            default: break;
          }
        }
        for (int g = 0; g < groups; ++g) CHECK(scattered[size_t(g)] == 1);
        for (int s = 0; s < S; ++s) CHECK(backward_done[size_t(s)] == q.micro_batches);
        for (int g = 0; g < groups; ++g) CHECK(!store.weights_bound(g));
      }
}
