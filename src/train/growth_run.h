// A run's moe.growth stages end to end: the stage a Trainer builds (that of the checkpoint or held
// state it starts from; a boundary checkpoint saved but not yet grown is grown on the way), and
// train_run, one Trainer per stage, each starting from the state the one before grew. Without
// growth a run is one stage: the config as given.
#pragma once

#include <cstdint>
#include <functional>

#include "config/config.h"
#include "parallel/world.h"
#include "train/checkpointing.h"
#include "train/growth.h"

namespace mop {

class Trainer;

// What a Trainer builds of a run.
struct RunStage {
  Config cfg;             // the stage's: with moe.growth, that stage's experts
  GrowthSchedule growth;  // the run's stages; empty without moe.growth
  int stage = 0;          // 0-based
};

// The stage a run of `cfg` (with moe.growth: the run's config, the last stage's experts) starts
// in: that of `held` (the state a growth boundary passed on in memory) or of the checkpoint it
// resumes, stage 0 for a fresh start. A checkpoint at a boundary that was saved but not grown (the
// job ended in between) is grown first; one whose experts are not its stage's is a UserError.
RunStage start_stage(const Config& cfg, World& world, const HeldCheckpoint* held);

// A whole `mop train` run of `cfg`: one Trainer per moe.growth stage (one without growth), each
// resuming from the grown checkpoint the one before wrote. `started` sees each Trainer before it
// runs (first: the run's first). Returns the last Trainer's step and stop signal.
struct RunOutcome {
  int64_t step = 0;
  int stop_signal = 0;
};
RunOutcome train_run(Config cfg, World& world, const std::function<void(Trainer&, bool first)>& started);

}  // namespace mop
