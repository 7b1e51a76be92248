// The optimizer step: global gradient norm, non-finite detection (naming the first offending
// parameter), clipping, AdamW on fp32 master weights with m and v, and the cast of the updated
// master weights into the compute weights. Each parameter's state lives either with the backend
// ("native": GPU memory on GPU runs, updated by the backend's AdamW) or in host memory, updated by
// the host AdamW engine through HostOffload (see host_offload.h), possibly overlapped with the next
// step's forward.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "core/memory.h"
#include "model/params.h"
#include "ops/ops.h"
#include "optim/host_offload.h"
#include "parallel/comm.h"

namespace mop {

struct StepReport {
  double grad_norm = 0;  // before clipping
  bool applied = false;  // false: skipped because of a non-finite gradient
  std::string nonfinite_param;  // the first parameter whose gradient is NaN/Inf, if any
};

// The forward stage that first reads parameter p: 0 embedding, 1..L layers, L+1 final norm and
// LM head (tied: the embedding's stage).
int param_stage(const ModelLayout& layout, int p);

class Optimizer {
 public:
  // state_on_host[p]: parameter p's state in host memory (empty: none). host_threads: worker threads of
  // the host engine (0: every core this rank may use). owned[p]: this rank keeps parameter p's
  // state and updates it (ZeRO-1: replicated parameters are updated by one rank each, which then
  // broadcasts the weights); empty: all.
  Optimizer(const OptimConfig& cfg, ParamStore& params, Ops& ops,
            std::vector<bool> state_on_host = {}, int host_threads = 0, std::vector<bool> owned = {});
  ~Optimizer();

  // Fresh start: master ← initial values (seeded), then weights ← master (every parameter's
  // weights, owned or not: initialisation is a pure function of the seed).
  void init_weights(uint64_t seed);
  // After loading master/m/v from a checkpoint: weights ← master (owned parameters).
  void sync_weights();

  // Checks the gradients, clips, updates. Nothing changes when a gradient is non-finite. The
  // caller has already reduced gradients over ranks. With optim.overlap, host updates may still
  // be running when this returns: weights_ready() gates each stage's next use.
  StepReport step(float lr);

  // Distributed gradient norm: parameters marked sharded (experts under expert parallelism) hold
  // only this rank's share, summed over `shard_comm`; a non-finite gradient anywhere is agreed over
  // `world` so every rank skips the same steps. Without this, everything is local.
  void set_distributed(std::vector<bool> sharded, Comm* shard_comm, Comm* world);

  // Pipeline hooks of the host-placed state (no-ops when there is none).
  void grads_final(int stage);   // from the last micro-batch's backward
  void weights_ready(int stage);  // before a forward reads the stage's weights
  void drain();                   // all host work finished (before reading state)
  OffloadStats take_offload_stats();
  HostOffload* offload() { return offload_.get(); }

  bool on_host(int p) const { return !on_host_.empty() && on_host_[p]; }
  bool owns(int p) const { return owned_.empty() || owned_[p]; }
  int num_host_params() const;
  Tensor master(int p) const { return state(0, p); }
  Tensor exp_avg(int p) const { return state(1, p); }
  Tensor exp_avg_sq(int p) const { return state(2, p); }
  Ops& ops() const { return ops_; }
  int64_t updates() const { return updates_; }  // steps applied (bias correction)
  void set_updates(int64_t n) { updates_ = n; }
  size_t native_state_bytes() const { return native_[0].bytes() * 3; }
  size_t host_state_bytes() const { return host_[0].bytes() * 3; }

 private:
  Tensor state(int which, int p) const;
  OptimConfig cfg_;
  ParamStore& params_;
  Ops& ops_;
  std::vector<bool> on_host_;
  std::vector<bool> owned_;
  std::vector<int64_t> offset_;  // per parameter, in its placement's buffers
  Buffer native_[3], host_[3];   // master, m, v
  Buffer norms_;                 // acc scalars: one Σg² per parameter
  std::unique_ptr<HostOffload> offload_;
  int64_t updates_ = 0;
  std::vector<bool> sharded_;
  Comm* shard_comm_ = nullptr;
  Comm* world_ = nullptr;
};

}  // namespace mop
