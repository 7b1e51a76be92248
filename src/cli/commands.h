// The `mop` subcommands, called by main() after argument parsing. Each returns the exit code;
// user errors propagate as UserError (main prints them and exits 2).
#pragma once

#include <string>
#include <vector>

#include "config/config.h"
#include "parallel/world.h"
#include "plan/machine.h"

namespace mop {

struct TrainArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string resume;  // empty: checkpoint.resume from the config
  int64_t profile_step = 0;
  std::string machine;  // empty: train.machine from the config
};
int cmd_train(const TrainArgs& args, World& world);

struct ValidateArgs {
  std::string config;
  std::vector<std::string> overrides;
  bool scan_data = false;  // check every token against the vocabulary
  std::string machine;     // the memory estimate's machine file; empty: built in
};
int cmd_validate(const ValidateArgs& args);

struct PlanArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string machine;  // machine file; empty: built-in h200 (cpu for train.device: cpu)
  int gpus = 0;         // ranks in all; 0: the config's foldings (or --nodes × GPUs per node)
  int nodes = 0;        // 0: the machine's
  bool search = false;  // rank every plan the config's open keys allow
  bool json = false;
  int top = 10;         // --search: plans listed
  bool program = false; // also print rank `rank`'s step program (plan/program.h)
  int rank = 0;
};
int cmd_plan(const PlanArgs& args);

// The machine and world size `mop plan` and `mop emulate` plan for: --machine FILE (else the
// built-in h200, cpu for train.device: cpu), --gpus ranks in all (spread over --nodes), else
// --nodes whole nodes (or the whole machine when `whole_machine`), else the config's foldings.
struct PlanTarget {
  Machine machine;
  int world = 1;
};
PlanTarget plan_target(const Config& cfg, const std::string& machine_file, int gpus, int nodes,
                       bool whole_machine);

struct CalibrateArgs {
  std::string out;              // machine file to write; empty: stdout
  std::string device = "auto";  // auto | cpu | cuda
  // A config whose step, run here on one rank, gives the in-step factors (DeviceSpec::in_step);
  // empty: none (factors of 1).
  std::string step_config;
  std::vector<std::string> step_overrides;
};
// Measures this machine (every rank of the job at once) and writes a machine file (calibrate.cpp).
int cmd_calibrate(const CalibrateArgs& args, World& world);

struct PrepareDataArgs {
  std::vector<std::string> inputs;
  std::string output;
  std::string split = "file";
  std::string tokenizer, eos_token, json_key;
  int64_t random_tokens = 0;  // > 0: random ids instead of text
  int64_t vocab_size = 0;
  int64_t document_tokens = 1 << 20;
  uint64_t seed = 0;
};
int cmd_prepare_data(const PrepareDataArgs& args);

struct GenerateArgs {
  std::string checkpoint;  // a step_N directory, or a checkpoint.dir (its latest)
  std::string prompt;
  int tokens = 200;
  double temperature = 0.8;
  int top_k = 40;
  uint64_t seed = 0;
};
int cmd_generate(const GenerateArgs& args);

}  // namespace mop
