// Trainer checkpoints: fp32 master weights under the Qwen3-MoE tensor names (model.safetensors),
// Adam moments (optimizer.safetensors) and manifest.json with the resolved config and the trainer
// state (step, data cursor, optimizer updates, seed, data fingerprint). Written atomically
// through the checkpoint-directory protocol of src/ckpt; loading verifies sizes and SHA-256.
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "ckpt/safetensors.h"
#include "config/config.h"
#include "data/tokenizer_files.h"
#include "optim/optimizer.h"
#include "parallel/groups.h"
#include "parallel/world.h"
#include "runtime/bulk_copy.h"

namespace mop {

struct TrainerState {
  int64_t step = 0;              // optimizer steps completed
  int64_t consumed_samples = 0;  // data cursor
  int64_t optimizer_updates = 0;
  uint64_t seed = 0;
  uint64_t data_fingerprint = 0;
  // With moe.growth: the stage (1-based) of `stages` whose model this is; 0 without growth.
  int64_t growth_stage = 0, growth_stages = 0;
};

// Writes <checkpoint.dir>/step_<N>/ and prunes old ones; every rank takes part (one rank per
// expert shard writes it; rank 0 the dense tensors, the tokenizer files and the manifest).
// groups: null for one rank; tokenizer: null when the run has none.
std::string save_checkpoint(const Config& cfg, const ParamStore& params, const Optimizer& optim,
                            const TrainerState& state, World& world, const ParallelGroups* groups,
                            const TokenizerFiles* tokenizer = nullptr);

// The tokenizer a run's checkpoints carry: data.tokenizer; else the one `mop prepare-data` wrote
// beside the shards (every shard's the same, or none has one); else that of `from`, the
// checkpoint the run resumes or starts from. UserError when its vocabulary does not fit
// model.vocab_size, when shards disagree, or when the data's tokenizer differs from the
// checkpoint's (unless data.tokenizer names the one to keep).
std::optional<TokenizerFiles> resolve_run_tokenizer(const Config& cfg, const std::optional<std::string>& from);

// The checkpoint to resume from for `mode` (none | auto | PATH), or nothing for a fresh start.
std::optional<std::string> resolve_resume_dir(const Config& cfg);

// The resolved config stored in a checkpoint's manifest.
Config checkpoint_config(const std::string& dir);
// Config keys under the given prefixes ("model.", "moe.") whose values differ between two configs:
// "model.qk_norm true → false, moe.top_k 8 → 4" ("" when none). The moe.growth* schedule keys
// are not compared (each stage's expert count is moe.num_experts).
std::string config_key_differences(const Config& saved, const Config& now,
                                   std::initializer_list<const char*> prefixes);

// Loads master weights (and, when `optim_state`, Adam moments) into `optim`; checks the stored
// model shape against `cfg` (UserError naming the first differing key).
TrainerState load_checkpoint(const std::string& dir, const Config& cfg, const ParamStore& params,
                             Optimizer& optim, bool optim_state);

// A one-rank checkpoint held in host memory — fp32 weights and Adam moments under their checkpoint
// names, the config they are of, the trainer state, the tokenizer — for a moe.growth boundary that
// passes the state to the next stage without files (train/growth.h).
struct HeldCheckpoint {
  struct Held {
    HostFloats values;
    SafetensorsTensor view;  // points into values
  };
  Config config;
  TrainerState state;
  std::optional<TokenizerFiles> tokenizer;
  std::map<std::string, Held> tensors;

  void put(const std::string& name, std::vector<int64_t> shape, HostFloats values);
  const SafetensorsTensor* find(const std::string& name) const;  // nullptr when absent
  size_t bytes() const;  // of every tensor
};
// Every tensor of a one-rank run's state (weights and moments), staged to host memory.
HeldCheckpoint hold_checkpoint(const Config& cfg, const ParamStore& params, const Optimizer& optim,
                               const TrainerState& state);
// Loads what load_checkpoint(…, optim_state = true) loads, from `held`, whose config must have
// cfg's model.
TrainerState load_held_checkpoint(const HeldCheckpoint& held, const Config& cfg, const ParamStore& params,
                                  Optimizer& optim);

}  // namespace mop
