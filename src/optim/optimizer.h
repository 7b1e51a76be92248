// The optimizer step: global gradient norm, non-finite detection (naming the first offending
// parameter), clipping, AdamW on fp32 master weights with m and v, and the cast of the updated
// master weights into the compute weights. Each parameter's state lives either with the backend
// ("native": GPU memory on GPU runs, updated here by the backend's AdamW) or in host memory: those
// parameters (host_params()) are updated by the host AdamW engine through the step's host
// pipeline (schedule/host_pipeline.h), with the arguments step() returns.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "config/config.h"
#include "model/params.h"
#include "ops/ops.h"
#include "runtime/comm.h"
#include "runtime/memory.h"

namespace mop {

// Per parameter, the device bytes of its gradient's sum of squares (the sumsq op's exact sum:
// three words and a flag).
constexpr int kGradNormWords = 4;
constexpr size_t kGradNormBytes = kGradNormWords * sizeof(int64_t);

struct StepReport {
  double grad_norm = 0;  // before clipping
  bool applied = false;  // false: skipped because of a non-finite gradient
  std::string nonfinite_param;  // the first parameter whose gradient is NaN/Inf, if any
  std::vector<AdamWArgs> host_args;  // applied: the update of each of host_params(), in order
};

// A parameter whose optimizer state is in host memory (this rank updates it).
struct HostParam {
  int param = 0;
  int segment = 0;      // model/params.h: 0 embedding, 1..L layers, L+1 final norm and LM head
  Tensor master, m, v;  // fp32, host memory
  Tensor grad;          // accumulated gradient on the ops device (fp32); no data when streamed
                        // (the schedule hands it to HostPipeline::grads_final)
  Tensor weights;       // compute weights on the ops device
};

class Optimizer {
 public:
  // state_on_host[p]: parameter p's state in host memory (empty: none). owned[p]: this rank keeps
  // parameter p's state and updates it (ZeRO-1: replicated parameters are updated by one rank
  // each, which then broadcasts the weights); empty: all.
  Optimizer(const OptimConfig& cfg, ParamStore& params, Ops& ops,
            std::vector<bool> state_on_host = {}, std::vector<bool> owned = {});
  ~Optimizer();

  // Fresh start: master ← initial values (seeded), then weights ← master (every parameter's
  // weights, owned or not: initialisation is a pure function of the seed).
  void init_weights(uint64_t seed);
  // After loading master/m/v from a checkpoint: weights ← master (owned parameters).
  void sync_weights();

  // Checks the gradients, clips, updates the native state. Nothing changes when a gradient is
  // non-finite. The caller has already reduced gradients over ranks, and hands host_args to the
  // host pipeline, which updates host_params().
  // defer_native: the native state's updates are left to the caller, who issues them with
  // update_native() (on an Ops of its own: another stream) once step() reports them applied.
  StepReport step(float lr, bool defer_native = false);
  // Parameter p's AdamW with the last step()'s arguments, on `ops` (the native state's device):
  // what step() runs for every native parameter this rank owns.
  void update_native(int p, Ops& ops) const;
  bool updates_natively(int p) const { return !on_host(p) && owns(p); }
  // Streamed gradients: Σg² of p's final gradient now, while it is still on the device (the same
  // kernel into the same slot step() would use; step() then leaves it).
  void take_norm(int p);
  // The host-placed parameters this rank updates, in forward order (segment by segment).
  const std::vector<HostParam>& host_params() const { return host_params_; }

  // Distributed gradient norm: per parameter the host comm over whose ranks its gradient's pieces
  // differ (plan/parallel_spec.h's norm_axes: stages, expert ranks, slices), its sum of squares
  // summed there; null: every rank holds the same, counted once. A non-finite gradient anywhere is
  // agreed over `world` so every rank skips the same steps. Without this, everything is local.
  void set_distributed(std::vector<Comm*> norm_comms, Comm* world);

  bool on_host(int p) const { return !on_host_.empty() && on_host_[p]; }
  bool owns(int p) const { return owned_.empty() || owned_[p]; }
  int num_host_params() const;
  // With sliced parameters (ParamStore::sliced) the state, the gradients it reads and the weights
  // it writes are this rank's slices ([slice_numel]); else whole parameters.
  Tensor master(int p) const { return state(0, p); }
  Tensor update_grad(int p) const;
  Tensor update_weights(int p) const;
  Tensor exp_avg(int p) const { return state(1, p); }
  Tensor exp_avg_sq(int p) const { return state(2, p); }
  Ops& ops() const { return ops_; }
  int64_t updates() const { return updates_; }  // steps applied (bias correction)
  void set_updates(int64_t n) { updates_ = n; }
  size_t native_state_bytes() const { return native_[0].bytes() * 3 + norms_.bytes(); }
  size_t host_state_bytes() const { return host_[0].bytes() * 3; }

 private:
  Tensor state(int which, int p) const;
  Tensor host_param_grad(int p) const;
  int64_t state_numel(int p) const;
  AdamWArgs with_decay(int p) const;
  OptimConfig cfg_;
  ParamStore& params_;
  Ops& ops_;
  std::vector<bool> on_host_;
  std::vector<bool> owned_;
  std::vector<int64_t> offset_;  // per parameter, in its placement's buffers
  Buffer native_[3], host_[3];   // master, m, v
  Tensor norm_slot(int p) const;
  Buffer norms_;                  // one exact Σg² per parameter (I64 [kNormWords] each)
  std::vector<char> norm_taken_;  // per parameter: its Σg² taken this step already (take_norm)
  std::vector<HostParam> host_params_;
  int64_t updates_ = 0;
  AdamWArgs args_;  // the last applied step's (weight decay per parameter on top)
  std::vector<Comm*> norm_comms_;  // per parameter (empty: all local)
  Comm* world_ = nullptr;
};

}  // namespace mop
