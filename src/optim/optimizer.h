// The optimizer step: global gradient norm, non-finite detection (naming the first offending
// parameter), clipping, AdamW on fp32 master weights with m and v, and the cast of the updated
// master weights into the compute weights. State lives in flat buffers with the ParamStore layout.
#pragma once

#include <string>

#include "config/config.h"
#include "core/memory.h"
#include "model/params.h"
#include "ops/ops.h"

namespace mop {

struct StepReport {
  double grad_norm = 0;  // before clipping
  bool applied = false;  // false: skipped because of a non-finite gradient
  std::string nonfinite_param;  // the first parameter whose gradient is NaN/Inf, if any
};

class Optimizer {
 public:
  Optimizer(const OptimConfig& cfg, ParamStore& params, Ops& ops, MemKind state_mem);

  // Fresh start: master ← initial values (seeded), then weights ← master.
  void init_weights(uint64_t seed);
  // After loading master/m/v from a checkpoint: weights ← master.
  void sync_weights();

  // Checks the gradients, clips, updates. Nothing changes when a gradient is non-finite. The
  // caller has already reduced gradients over ranks.
  StepReport step(float lr);

  Tensor master(int p) const { return params_.shaped(master_, DType::F32, p); }
  Tensor exp_avg(int p) const { return params_.shaped(m_, DType::F32, p); }
  Tensor exp_avg_sq(int p) const { return params_.shaped(v_, DType::F32, p); }
  // The whole state buffers (ParamStore layout), for checkpoints.
  Tensor master_flat() const { return flat(master_); }
  Tensor exp_avg_flat() const { return flat(m_); }
  Tensor exp_avg_sq_flat() const { return flat(v_); }
  Ops& ops() const { return ops_; }
  int64_t updates() const { return updates_; }  // steps applied (bias correction)
  void set_updates(int64_t n) { updates_ = n; }
  size_t state_bytes() const { return master_.bytes() + m_.bytes() + v_.bytes(); }

 private:
  Tensor flat(const Buffer& b) const {
    return Tensor(b.data(), DType::F32, {params_.total_elements()}, b.device());
  }
  OptimConfig cfg_;
  ParamStore& params_;
  Ops& ops_;
  Buffer master_, m_, v_;
  Buffer norms_;  // acc scalars: one Σg² per parameter
  int64_t updates_ = 0;
};

}  // namespace mop
