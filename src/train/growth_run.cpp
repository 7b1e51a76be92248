// The stage a Trainer builds and the run's stage loop (see growth_run.h).
#include "train/growth_run.h"

#include <spdlog/spdlog.h>

#include <chrono>
#include <filesystem>
#include <memory>
#include <optional>
#include <string>
#include <utility>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"
#include "core/error.h"
#include "model/model_spec.h"
#include "train/trainer.h"

namespace mop {

RunStage start_stage(const Config& cfg, World& world, const HeldCheckpoint* held) {
  RunStage s{cfg, growth_schedule(cfg), 0};
  const GrowthSchedule& g = s.growth;
  if (g.empty()) return s;
  // The stage of the checkpoint (or held state) this run starts from; a boundary step's is the
  // next stage's.
  const std::optional<std::string> from = held ? std::nullopt : resolve_resume_dir(cfg);
  const int64_t step = held ? held->state.step : from ? read_manifest(*from).step : 0;
  const int stage = s.stage = g.stage_at(step);
  const int64_t want = g.experts[size_t(stage)];
  MOP_CHECK(!held || held->config.moe.num_experts == want, "the held state has ",
            held->config.moe.num_experts, " experts, stage ", stage + 1, " ", want);
  if (from) {
    const int64_t has = checkpoint_config(*from).moe.num_experts;
    // Saved at a boundary but not yet grown (the job ended in between): grow it now.
    if (has != want && stage > 0 && g.is_boundary(step) && has == g.experts[size_t(stage - 1)]) {
      if (world.is_root()) {
        spdlog::warn("growth: {} was saved at the end of stage {} but not grown; growing it", *from, stage);
        grow_checkpoint(*from, growth_options(cfg, g, stage));
      }
      world.comm->barrier();
    } else {
      MOP_USER_CHECK(has == want, "checkpoint ", *from, " at step ", step, " has ", has, " experts per MoE "
                     "layer; moe.growth has ", want, " at that step (stage ", stage + 1, " of ",
                     g.stages(), "): resume with the schedule that wrote it");
    }
  }
  const int64_t first = stage ? g.end_step[size_t(stage - 1)] + 1 : 1;
  spdlog::info("growth: stage {} of {}: {} experts per MoE layer for steps {}–{}{}", stage + 1,
               g.stages(), want, first, g.end_step[size_t(stage)],
               stage + 1 < g.stages() ? fmt::format(", then {}", g.experts[size_t(stage + 1)])
                                      : std::string());
  s.cfg = stage_config(cfg, g, stage);
  return s;
}

RunOutcome train_run(Config cfg, World& world, const std::function<void(Trainer&, bool first)>& started) {
  auto params_of = [](const Plan& p) { return double(ModelLayout::build(ModelDims::from(p.cfg)).num_params()); };
  std::shared_ptr<const HeldCheckpoint> next;  // the grown state, when held in memory
  Plan was;
  int64_t at = 0;
  std::chrono::steady_clock::time_point since;  // the last stage's end
  for (bool first = true;; first = false) {
    RunStage stage = start_stage(cfg, world, next.get());
    auto t = std::make_unique<Trainer>(std::move(stage), world, std::move(next));
    if (!first) {
      const Plan& now = t->plan();
      const double boundary_seconds =
          std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
      spdlog::info("growth: step {}: {} → {} experts per MoE layer; parameters {:.4g}M → {:.4g}M, optimizer "
                   "state on the host {:.4g}M → {:.4g}M parameters, predicted step {:.4g} → {:.4g} ms; the "
                   "boundary took {:.1f} s",
                   at, was.cfg.moe.num_experts, now.cfg.moe.num_experts, params_of(was) / 1e6, params_of(now) / 1e6,
                   was.host_params / 1e6, now.host_params / 1e6, 1e3 * was.time.step, 1e3 * now.time.step,
                   boundary_seconds);
    }
    started(*t, first);
    t->run();
    if (!t->grew()) return {t->step(), t->stop_signal()};
    std::shared_ptr<HeldCheckpoint> held = t->take_held();
    const GrowthOptions o = growth_options(cfg, t->growth(), t->growth_stage() + 1);
    was = t->plan(), at = t->step(), since = t->grew_at();
    t.reset();  // the old stage's memory goes before the grown state and the next stage's
    if (held)
      next = std::make_shared<const HeldCheckpoint>(grow_held(std::move(*held), o));
    else
      cfg.checkpoint.resume = (std::filesystem::path(cfg.checkpoint.dir) / checkpoint_dir_name(at)).string();
  }
}

}  // namespace mop
