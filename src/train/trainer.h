// Trainer: builds the run in one fixed order — the plan (plan/plan.h: foldings, placement, memory,
// predicted time), backend and side streams, parallel groups, model layout and parameters, data,
// activations, optimizer state, the step's schedule, weights (fresh or resumed) — checks that what
// it allocated is what the plan said, logs one summary, then runs the step loop: the schedule's
// gradients and update → metrics → evaluation → checkpoint.
#pragma once

#include <chrono>
#include <functional>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/loader.h"
#include "data/step_batches.h"
#include "data/tokenizer_files.h"
#include "model/model_chunks.h"
#include "ops/timed_ops.h"
#include "optim/optimizer.h"
#include "parallel/groups.h"
#include "parallel/sequence_parallel.h"
#include "parallel/world.h"
#include "plan/plan.h"
#include "schedule/step.h"
#include "schedule/streams.h"
#include "train/checkpointing.h"
#include "train/growth_run.h"  // the stage a Trainer builds; train_run, a Trainer per stage
#include "train/metrics.h"
#include "train/signals.h"  // what stops run(); `mop train` and the tests hold them too

namespace mop {

TokenLoaderOptions make_loader_options(const Config& cfg);

// The machine a run plans for: train.machine's file, or the built-in description of the device it
// runs on (with a GPU, its kind's by name: builtin_for_gpu; else cpu) — either way with the device memory this process finds free
// at start (the least over the ranks, so every rank makes the same plan), this host's memory, and
// the world's ranks per node.
Machine run_machine(const Config& cfg, World& world);
// The configuration a run trains with: cfg itself, or with train.plan: auto the first plan of
// `mop plan --search` for this machine (the keys cfg pins kept).
Config planned_config(const Config& cfg, const Machine& machine, int world);

class Trainer {
 public:
  // Builds `stage` (start_stage's). `held`: the state a growth boundary passed on in memory
  // (train_run), instead of a checkpoint.
  Trainer(RunStage stage, World& world, std::shared_ptr<const HeldCheckpoint> held = nullptr);
  // With moe.growth, `cfg` is the run's (the last stage's experts): the Trainer builds the stage
  // the checkpoint it starts from belongs to (stage 0 for a fresh start).
  Trainer(const Config& cfg, World& world, std::shared_ptr<const HeldCheckpoint> held = nullptr);
  // Planned for `machine` as given, instead of the machine this process finds (run_machine): an
  // emulated rank of a job on another machine (`mop emulate`).
  Trainer(const Config& cfg, World& world, const Machine& machine);
  ~Trainer();
  // Trains to train.steps (or until SIGTERM/SIGINT/SIGUSR1, after which it checkpoints and
  // returns), or to the end of its moe.growth stage: then grew(), and the next stage (train_run)
  // starts from the boundary checkpoint, already grown, or from take_held(), to be grown.
  void run();
  bool grew() const { return grew_; }
  // When this stage ended at its growth boundary (before the state was staged or saved).
  std::chrono::steady_clock::time_point grew_at() const { return grew_at_; }
  // After a growth on one rank with no checkpoint due at the boundary: the state, held in host
  // memory for the next stage (nullptr when the boundary checkpoint holds it).
  std::shared_ptr<HeldCheckpoint> take_held() { return std::move(held_out_); }
  int growth_stage() const { return stage_; }
  const GrowthSchedule& growth() const { return growth_; }
  // Called once, when this run first saves a checkpoint (or finishes without one): what a run
  // writes about itself, such as config.resolved.yaml, waits until it has something to show.
  void set_on_started(std::function<void()> f) { on_started_ = std::move(f); }
  int64_t step() const { return step_; }
  // The signal that stopped run() (the largest number over the ranks; 0: it was not stopped).
  int stop_signal() const { return stop_signal_; }
  const Config& config() const { return cfg_; }
  const Plan& plan() const { return plan_; }

  // The current step's gradients (all micro-batches, reduced over ranks) and its losses: what a
  // step does before the optimizer. Public for the multi-rank invariance tests.
  struct StepLosses {
    double loss = 0, aux = 0, z = 0;
  };
  StepLosses compute_gradients();
  const ParamStore& params() const { return *params_; }
  const ModelLayout& layout() const { return layout_; }
  // What this rank allocated, by the plan's classes (MemoryPlan): the plan's estimate of this
  // rank (plan().memory_of_rank) must equal it.
  MemoryPlan allocated_memory() const;
  // One training step as run() takes it, without logging, evaluation or checkpoints (`mop
  // emulate`); its metrics (times, seconds) returned.
  StepMetrics step_once();
  // The device memory in use before this run allocated anything (GPU runs).
  size_t device_used_at_start() const { return device_used_at_start_; }

 private:
  void build();
  void resume_or_init();
  // Micro-batch m of batches_ as the model reads it: on the ops device (a copy on GPUs).
  Batch micro_batch(int m);
  void train_step(StepMetrics& sm);
  double evaluate();
  void save_checkpoint();
  // log.router_histogram: every rank's routed rows summed, written by rank 0 (a collective).
  void save_router_histogram();
  TrainerState drained_state();  // after the host pipeline drained: what a checkpoint records
  bool stop_requested();
  void check_plan_memory();
  size_t planned_device_bytes() const;  // what this rank allocated on the ops device

  int stop_signal_ = 0;
  Config cfg_;
  World& world_;
  Plan plan_;
  std::unique_ptr<Ops> ops_;  // a TimedOps around the backend
  TimedOps* timed_ = nullptr;
  ModelLayout layout_;
  std::unique_ptr<SideStreams> streams_;     // outlive the comms that run on them
  std::unique_ptr<ParallelGroups> groups_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<Optimizer> optim_;
  std::unique_ptr<TokenLoader> loader_;
  std::unique_ptr<ModelChunks> model_;  // one chunk, or a pipeline rank's
  std::unique_ptr<StepSchedule> schedule_;  // before the optimizer and model in destruction
  std::unique_ptr<MetricsLog> metrics_;
  std::optional<TokenizerFiles> tokenizer_;  // saved into every checkpoint
  GrowthSchedule growth_;  // empty without moe.growth
  int stage_ = 0;
  bool grew_ = false;
  std::chrono::steady_clock::time_point grew_at_;
  std::shared_ptr<const HeldCheckpoint> held_in_;  // the state this stage starts from, if in memory
  std::optional<Machine> machine_;  // the machine to plan for as given (else run_machine's)
  std::shared_ptr<HeldCheckpoint> held_out_;

  int64_t step_ = 0;             // optimizer steps done
  int64_t consumed_samples_ = 0;  // global training samples consumed
  std::unique_ptr<SequenceSlicer> slicer_;  // this cp rank's tokens of the sequences read
  std::unique_ptr<StepBatches> batches_;    // this rank's micro-batches of the step, on the host
  int64_t step_valid_tokens_ = 0;                   // unmasked targets of the step, all ranks
  int64_t last_saved_step_ = -1;
  int64_t histogram_step_ = -1;  // the step the router histogram was last written at
  Buffer batch_dev_;  // one micro-batch's ids, targets, positions on the GPU
  size_t device_used_at_start_ = 0;
  std::function<void()> on_started_;
};

}  // namespace mop
