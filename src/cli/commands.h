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
  bool scan_data = false;   // check every token against the vocabulary
  std::string machine;      // the memory estimate's machine file; empty: as `mop plan`
  int gpus = 0, nodes = 0;  // as `mop plan`
};
int cmd_validate(const ValidateArgs& args);

struct PlanArgs {
  std::string config;
  std::vector<std::string> overrides;
  std::string machine;  // machine file; empty: see plan_target
  int gpus = 0;         // ranks in all; 0: see plan_target
  int nodes = 0;        // 0: the machine's
  bool search = false;  // rank every plan the config's open keys allow
  bool json = false;
  int top = 10;         // --search: plans listed
  bool program = false; // also print rank `rank`'s step program (plan/program.h)
  int rank = 0;
};
int cmd_plan(const PlanArgs& args);

// The machine and world size `mop plan`, `validate` and `emulate` plan for (plan_commands.cpp).
// The machine: --machine FILE; else on a machine without a GPU, for train.device: auto and no
// --gpus/--nodes, the CPU backend (what `mop train` runs here); else the built-in description of
// this machine's GPUs (by name, builtin_for_gpu), or the h200 on a machine without one (cpu for
// train.device: cpu). The ranks: --gpus in all (spread
// over --nodes); else --nodes whole nodes, the whole machine when `whole_machine`, or a machine
// file's every GPU where the config gives no foldings; else the config's foldings. `notes` say
// which machine or ranks where the user did not name them, and why.
struct PlanTarget {
  Machine machine;
  int world = 1;
  int node_gpus = 1;  // GPUs of one of the machine's nodes, before --gpus took fewer
  std::vector<std::string> notes;
};
PlanTarget plan_target(const Config& cfg, const std::string& machine_file, int gpus, int nodes,
                       bool whole_machine);

// The job the three describe: its target, and the config to plan — `cfg` itself, or where its
// foldings do not make the target's ranks (no layout given for them) or it asks for the plan's
// (train.plan: auto), the fastest plan that fits as `mop plan --search` ranks them, with a note
// saying so. No plan fitting is a UserError saying what would (no_fit_message).
struct PlanJob {
  PlanTarget target;
  Config cfg;
  std::string chosen;  // the search's settings; "" where cfg's own layout is planned
};
PlanJob plan_job(const Config& cfg, const std::string& machine_file, int gpus, int nodes);
// "no plan fits M with N rank(s)", the reasons by count, and the nearest world sizes or global
// batch sizes with a plan that fits (search.h's fit_advice).
struct SearchResult;
std::string no_fit_message(const Config& cfg, const PlanTarget& target, const std::string& machine_file,
                           const SearchResult& result);

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
