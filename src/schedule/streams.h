// The step's side streams: device work that overlaps the compute stream runs on streams of its
// own — the data-parallel gradient sums, ring attention's K/V passes, the expert exchange's two
// directions, sliced parameters' weight gathers — made once, before the comms that run on them (ParallelGroups), and destroyed after
// them. Which exist follows the plan; the CPU has none (its comms block). The host pipeline's
// copy and upload streams are its own (host_pipeline_staged.cpp).
#pragma once

#include "parallel/groups.h"
#include "plan/plan.h"
#include "runtime/runtime.h"

namespace mop {

class SideStreams {
 public:
  explicit SideStreams(const Plan& plan) {
    const Device d = plan.run.device;
    if (d == Device::CPU || plan.world == 1) return;
    if (plan.cfg.parallel.overlap_grad_reduce) grad_sums_ = OwnedStream(d);
    if (plan.ring) ring_ = OwnedStream(d);
    if (plan.ep > 1) dispatch_ = OwnedStream(d), combine_ = OwnedStream(d);
    if (plan.parallel.sliced()) gathers_ = OwnedStream(d);
  }
  CommStreams comm_streams() const {
    return {grad_sums_.get(), ring_.get(), dispatch_.get(), combine_.get(), gathers_.get()};
  }

 private:
  OwnedStream grad_sums_, ring_, dispatch_, combine_, gathers_;
};

}  // namespace mop
