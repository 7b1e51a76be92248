// Streamed gradients (optim.gradients: host) against kept ones (gpu), on CPU ranks with all
// optimizer state on the host: twenty steps give the same losses and norms and a final checkpoint
// with the same bytes in every tensor, over one rank and two in-process ranks (dp or cp; ZeRO-1
// owners: every rank streams every segment, and sends to the host only what it owns), one
// micro-batch and several (the running sums go to the host and come back), tied and untied
// embeddings; a run resumes across a change (kept → streamed, at step 10) to the same bytes.
// Gradient clipping binds in every step: the global norm is exact, the same bits whichever way the
// gradients reach it. The program's slots are checked against the store.
#include <filesystem>
#include <functional>
#include <map>
#include <string>

#include <spdlog/spdlog.h>

#include "catch.h"
#include "model/params.h"
#include "parallel/inprocess_comm.h"
#include "parallel/run_compare.h"
#include "plan/program.h"
#include "train/train_test_util.h"
#include "train/trainer.h"

using namespace mop;

namespace {

const double kClip = 0.05;  // below every step's norm here: clipping binds throughout

struct Layout {
  int dp = 1, ep = 1, micro_batches = 1;
  bool tied = false;
  int cp = 1;
};

std::string config(const std::string& corpus, const std::string& dir, const Layout& l, const std::string& gradients,
                   int steps) {
  const int micro = 2;
  return test::compare_model_yaml(l.tied, corpus) +
         "optim: {lr: 0.01, schedule: constant, warmup_steps: 0, grad_clip: " +
         std::to_string(kClip) +
         ", state_placement: host, "
         "gradients: " +
         gradients +
         "}\n"
         "train: {steps: " +
         std::to_string(steps) +
         ", global_batch_size: " + std::to_string(micro * l.dp * l.micro_batches) +
         ", micro_batch_size: " + std::to_string(micro) +
         ", eval_interval: 0, device: cpu}\n"
         "parallel: {attention: {cp: " +
         std::to_string(l.cp) + ", dp: " + std::to_string(l.dp) +
         "}, moe: {ep: " + std::to_string(l.ep) + ", dp: " + std::to_string(l.cp * l.dp / l.ep) +
         "}}\n"
         "checkpoint: {dir: " +
         dir +
         ", interval: 0, keep_last: 0, resume: auto}\n"
         "log: {interval: 1}\n";
}

const int kSteps = 20;
void train_layout(const std::string& corpus, const std::string& root, const Layout& l,
                  const std::function<World()>& world) {
  auto train = [&](const std::string& dir, const std::string& gradients, int steps) {
    World w = world();
    Trainer t(load_config_text(config(corpus, root + "/" + dir, l, gradients, steps)), w);
    if (gradients == "host") REQUIRE(t.plan().stream_grads);
    else REQUIRE(!t.plan().stream_grads);
    t.run();
  };
  train("kept", "gpu", kSteps);
  train("streamed", "host", kSteps);
  train("ks", "gpu", kSteps / 2);
  train("ks", "host", kSteps);
}

void check_layout(const std::string& root) {
  test::check_same_runs(root, "kept", "streamed", {"loss", "grad_norm"}, {"streamed", "ks"}, kSteps);
  CHECK(test::steps_clipped(root + "/kept", kClip) == kSteps);
}

}  // namespace

TEST_CASE("streamed gradients on one rank equal kept ones, bit for bit", "[cpu][stream]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 40000);
  int i = 0;
  for (const Layout l : {Layout{1, 1, 1}, Layout{1, 1, 3}, Layout{1, 1, 1, true}, Layout{1, 1, 2, true}}) {
    INFO("micro-batches " << l.micro_batches << " tied " << l.tied);
    const std::string root = dir / ("run" + std::to_string(i++));
    train_layout(corpus, root, l, [] {
      World w;
      w.comm = make_self_comm();
      return w;
    });
    check_layout(root);
  }
}

TEST_CASE("streamed gradients on 2 in-process ranks (cp or dp; ZeRO-1 owners) equal kept ones, bit for bit",
          "[cpu][stream]") {
  spdlog::set_level(spdlog::level::warn);
  test::TempDir dir;
  const std::string corpus = test::prepare_corpus(dir, 40000);
  int i = 0;
  for (const Layout l : {Layout{2, 2, 1}, Layout{2, 1, 2, true}, Layout{1, 2, 2, false, 2}}) {
    INFO("cp " << l.cp << " dp " << l.dp << " ep " << l.ep << " micro-batches " << l.micro_batches << " tied " << l.tied);
    const std::string root = dir / ("run" + std::to_string(i++));
    std::shared_ptr<InProcessWorld> ranks = make_inprocess_world(2);
    run_inprocess(2, [&](int rank) { train_layout(corpus, root, l, [&] { return inprocess_world(ranks, rank, 2); }); });
    check_layout(root);
  }
}

// The program against the store's slots, for a mix of streamed and kept segments: every forward
// and backward that writes a streamed group's gradients finds its slot bound (the fused head in
// its forward, a tied embedding from the head's forward to the embedding's backward), at most the
// two shared slots are used, and a streamed segment leaves its slot after each micro-batch's
// backward: the running sum stashed, or (the last) summed, its norms taken and sent to the host.
TEST_CASE("program: streamed gradients hold a slot only while in flight", "[cpu][plan][stream]") {
  for (const bool tied : {false, true})
    for (const int mb : {1, 3})
      for (const std::vector<bool>& streamed :
           {std::vector<bool>{true, true, true, true}, std::vector<bool>{true, false, true, false},
            std::vector<bool>{false, true, false, true}}) {
        INFO("tied " << tied << " micro-batches " << mb << " streamed " << streamed[0] << streamed[1] << streamed[2]
                     << streamed[3]);
        Layout l;
        l.tied = tied;
        const ModelLayout layout = ModelLayout::build(ModelDims::from(load_config_text(config("c", "d", l, "gpu", 1))));
        REQUIRE(num_segments(layout.dims) == 4);
        ParamStore store(layout, DType::F32, DType::F32, MemKind::Host, PooledGrads{streamed, false});
        ProgramShape shape;
        shape.segments = 4, shape.micro_batches = mb, shape.reduce = true, shape.tied = tied;
        shape.streamed = streamed;
        shape.host_segments = {true, false, true, true};  // this rank owns host state in three
        const StepProgram p = make_step_program(shape);
        const int S = 4, groups = store.num_gather_groups();
        std::vector<int> stashed(size_t(S), 0), sent(size_t(S), 0), normed(size_t(S), 0);
        for (const Action& a : p.gradients) {
          switch (a.kind) {
            case ActionKind::GradSlot: store.bind_grads(a.begin); break;  // throws with no free slot
            case ActionKind::ReleaseGrads: store.release_grads(a.begin); break;
            case ActionKind::StashGrads:
              ++stashed[size_t(a.begin)];
              CHECK(store.grads_bound(a.begin));
              break;
            case ActionKind::GradNorms: ++normed[size_t(a.begin)]; break;
            case ActionKind::GradsToHost: ++sent[size_t(a.begin)]; break;
            case ActionKind::Forward:
            case ActionKind::Backward:
              if (a.kind == ActionKind::Backward || a.begin == S - 1) {
                CHECK(store.grads_bound(a.begin));
                if (tied && (a.begin == 0 || a.begin == S - 1)) CHECK(store.grads_bound(S));
              }
              break;
            default: break;
          }
        }
        for (int g = 0; g < groups; ++g) CHECK(!store.grads_bound(g) == store.group_pooled(g));  // all freed
        for (int s = 0; s < S; ++s) {
          CHECK(stashed[size_t(s)] == (streamed[size_t(s)] ? mb - 1 : 0));
          CHECK(normed[size_t(s)] == (streamed[size_t(s)] ? 1 : 0));
          CHECK(sent[size_t(s)] == (shape.host_segments[size_t(s)] ? 1 : 0));
        }
      }
}
