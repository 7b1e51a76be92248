// Trainer checkpoints: fp32 master weights under the Qwen3-MoE tensor names (model.safetensors),
// Adam moments (optimizer.safetensors) and manifest.json with the resolved config and the trainer
// state (step, data cursor, optimizer updates, seed, data fingerprint). Written atomically
// through the checkpoint-directory protocol of src/ckpt; loading verifies sizes and SHA-256.
#pragma once

#include <cstdint>
#include <optional>
#include <string>

#include "config/config.h"
#include "optim/optimizer.h"
#include "parallel/groups.h"
#include "parallel/world.h"

namespace mop {

struct TrainerState {
  int64_t step = 0;              // optimizer steps completed
  int64_t consumed_samples = 0;  // data cursor
  int64_t optimizer_updates = 0;
  uint64_t seed = 0;
  uint64_t data_fingerprint = 0;
};

// Writes <checkpoint.dir>/step_<N>/ and prunes old ones; every rank takes part (one rank per
// expert shard writes it; rank 0 the dense tensors and the manifest). groups: null for one rank.
std::string save_checkpoint(const Config& cfg, const ParamStore& params, const Optimizer& optim,
                            const TrainerState& state, World& world, const ParallelGroups* groups);

// The checkpoint to resume from for `mode` (none | auto | PATH), or nothing for a fresh start.
std::optional<std::string> resolve_resume_dir(const Config& cfg);

// The resolved config stored in a checkpoint's manifest.
Config checkpoint_config(const std::string& dir);
// Config keys under the given prefixes ("model.", "moe.") whose values differ between two configs:
// "model.qk_norm true → false, moe.top_k 8 → 4" ("" when none).
std::string config_key_differences(const Config& saved, const Config& now,
                                   std::initializer_list<const char*> prefixes);

// Loads master weights (and, when `optim_state`, Adam moments) into `optim`; checks the stored
// model shape against `cfg` (UserError naming the first differing key).
TrainerState load_checkpoint(const std::string& dir, const Config& cfg, const ParamStore& params,
                             Optimizer& optim, bool optim_state);

}  // namespace mop
