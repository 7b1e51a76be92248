// Trainer: builds the run in one fixed order — backend, model layout and parameters, optimizer
// state, data, activation plan, weights (fresh or resumed) — logs one summary line, then runs the
// step loop: micro-batches → gradient reduction → optimizer → metrics → evaluation → checkpoint.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "data/loader.h"
#include "model/transformer.h"
#include "ops/timed_ops.h"
#include "optim/optimizer.h"
#include "parallel/grad_reducer.h"
#include "parallel/groups.h"
#include "parallel/world.h"
#include "train/metrics.h"

namespace mop {

// How the step runs on this machine: backend device and dtypes.
struct RunPlacement {
  Device device = Device::CPU;
  DType compute = DType::F32;
  DType grad = DType::F32;
  std::string describe() const;
};
RunPlacement resolve_placement(const Config& cfg);

// Memory the run needs per rank, before anything is allocated.
struct MemoryEstimate {
  size_t weights = 0, grads = 0, optimizer = 0, activations = 0;
  size_t total() const { return weights + grads + optimizer + activations; }
};
MemoryEstimate estimate_memory(const Config& cfg, const RunPlacement& placement);

std::unique_ptr<Ops> make_ops(const RunPlacement& placement, int local_rank = 0);
TokenLoaderOptions make_loader_options(const Config& cfg);

class Trainer {
 public:
  Trainer(Config cfg, World& world);
  ~Trainer();
  // Trains to train.steps (or until SIGTERM/SIGINT, after which it checkpoints and returns).
  void run();
  int64_t step() const { return step_; }

  // The current step's gradients (all micro-batches, reduced over ranks) and its losses: what a
  // step does before the optimizer. Public for the multi-rank invariance tests.
  struct StepLosses {
    double loss = 0, aux = 0, z = 0;
  };
  StepLosses compute_gradients();
  const ParamStore& params() const { return *params_; }
  const ModelLayout& layout() const { return layout_; }

 private:
  void build();
  void resume_or_init();
  void fill_step_batches();
  // Samples [first, first + micro_batch) of the training (or validation) split; keeps this rank's
  // tokens of every sequence. Returns the unmasked targets among them.
  int64_t fill_local(int64_t first, bool valid_split, int32_t* ids, int32_t* targets, int32_t* positions);
  // Data-parallel gradient sums: each stage's as soon as the last micro-batch's backward finishes
  // it (overlapped with the rest of backward on GPUs), then the rest, then the compute waits.
  void reduce_stage(int stage);
  void join_reductions();
  void reduce_gradients();
  // ZeRO-1: which rank updates each parameter (rank in its replica group); this rank's share.
  std::vector<bool> assign_owners();
  void broadcast_weights();  // from each parameter's owner to the rest of its group
  Batch micro_batch(int m);
  void train_step(StepMetrics& sm);
  double evaluate();
  void save_checkpoint();
  bool stop_requested();
  size_t device_memory_used() const;  // bytes in use on this rank's GPU (0 on the CPU)
  size_t device_memory_free() const;
  std::vector<bool> choose_state_placement();  // per parameter: optimizer state on the host
  int64_t host_param_elements(const std::vector<bool>& on_host) const;

  Config cfg_;
  World& world_;
  RunPlacement placement_;
  std::unique_ptr<Ops> ops_;  // a TimedOps around the backend
  TimedOps* timed_ = nullptr;
  double flops_per_token_ = 0;
  ModelLayout layout_;
  std::unique_ptr<ParamStore> params_;
  std::unique_ptr<Optimizer> optim_;
  std::unique_ptr<TokenLoader> loader_;
  std::unique_ptr<Transformer> model_;
  std::unique_ptr<MetricsLog> metrics_;

  int64_t step_ = 0;             // optimizer steps done
  int64_t consumed_samples_ = 0;  // global training samples consumed
  int micro_batches_ = 1;        // per optimizer step on this rank
  int dp_rank_ = 0, dp_size_ = 1;
  std::vector<int32_t> ids_, targets_, positions_;  // this rank's micro-batches of the step
  std::unique_ptr<ParallelGroups> groups_;
  std::unique_ptr<GradReducer> reducer_;  // several ranks only; before groups_ in destruction
  std::vector<std::vector<int>> stage_params_;  // parameters by stage (param_stage)
  std::vector<bool> stage_reduced_;             // this step's sums issued
  std::vector<bool> stage_has_host_state_;      // a host update reads this stage's gradients
  int local_seq_ = 0;                    // tokens of each sequence on this rank (S / cp)
  std::vector<int> owner_;               // ZeRO-1 owner of each parameter within its group
  std::vector<int> local_positions_;     // cp > 1: which positions of a sequence this rank holds
  std::vector<int32_t> full_ids_, full_targets_, full_positions_;  // cp > 1: staging
  int64_t step_valid_tokens_ = 0;                   // unmasked targets of the step, all ranks
  int64_t last_saved_step_ = -1;
  Buffer batch_dev_;  // one micro-batch's ids, targets, positions on the GPU
  bool last_micro_batch_ = false;  // gradients become final in this backward
  size_t device_used_at_start_ = 0, planned_device_bytes_ = 0;
};

}  // namespace mop
