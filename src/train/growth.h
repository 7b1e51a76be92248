// Progressive expert growth (moe.growth, moe.growth_from): a run starts with few experts per MoE
// layer and grows the pool in stages, each expert becoming whole copies of itself. At a boundary a
// new Trainer for the next stage starts from the grown state as a resume does (planned and
// allocated anew): on one rank with no checkpoint due, from the state held in host memory
// (grow_held); else from the boundary checkpoint, rewritten in place with the grown experts
// (grow_checkpoint). Both give the same values, and a run resumed before, at or after a boundary
// follows the same path as one that never stopped.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "config/config.h"
#include "train/checkpointing.h"

namespace mop {

struct GrowthSchedule {
  std::vector<int64_t> experts;   // per stage
  std::vector<int64_t> end_step;  // the last step of each stage (the last stage's: train.steps)

  bool empty() const { return experts.empty(); }
  int stages() const { return int(experts.size()); }
  // The stage whose model a checkpoint at `step` holds: a boundary step's checkpoint is grown, so
  // it belongs to the next stage. 0 without growth.
  int stage_at(int64_t step) const;
  // Whether `step` ends a stage that another follows.
  bool is_boundary(int64_t step) const;
};

// The stages of a run's config (moe.growth, or the doubling of moe.growth_from), budgets resolved
// to steps. A run's config names the last stage's experts in moe.num_experts (UserError
// otherwise; the config of a stage's checkpoint names that stage's). Empty without growth.
GrowthSchedule growth_schedule(const Config& cfg);

// `cfg` with the experts of stage `stage`: what the stage's Trainer builds and its checkpoints
// record.
Config stage_config(const Config& cfg, const GrowthSchedule& schedule, int stage);

struct GrowthOptions {
  int64_t experts = 0;      // per MoE layer after the growth: a multiple of the checkpoint's
  double noise = 0;         // relative std of the noise on the copies' router rows
  bool copy_moments = true; // false: the experts' and the router's Adam moments start at zero
  uint64_t seed = 0;
  int64_t stage = 0, stages = 0;  // the moe.growth stage the grown model begins (1-based), or 0
};
// The options of the growth into stage `stage` (0-based) of `schedule`, from cfg.moe.
GrowthOptions growth_options(const Config& cfg, const GrowthSchedule& schedule, int stage);
// Rewrites the checkpoint directory `dir` (step_N, whole and verified) in place, atomically, as
// the same step with options.experts experts per MoE layer: expert e of E becomes experts
// e·f … e·f + f − 1 (f = experts / E) with its gate/up/down weights (and moments, or zeros);
// router row e is copied to rows e·f + i, rows i > 0 with N(0, (noise · rms(row))²) added. Every
// other tensor and file (the tokenizer) is kept as it is; the manifest records the new config
// and, with options.stage, the stage (else it records none).
void grow_checkpoint(const std::string& dir, const GrowthOptions& options);
// The same for a state held in memory (a one-rank run's boundary without a checkpoint due): the
// grown tensors, config, trainer state and tokenizer — what grow_checkpoint would write, value for
// value. Consumes `held` (its tensors move into the result where they are kept).
HeldCheckpoint grow_held(HeldCheckpoint&& held, const GrowthOptions& options);

}  // namespace mop
