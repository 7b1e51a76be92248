// GradReducer: the data-parallel gradient sums, issued segment by segment as backward finishes
// them, each gradient over the ranks that hold its parameter (its replica axes: kDenseReplicas for
// dense parameters, kExpertReplicas for experts). On the GPU the sums run on their own stream,
// through their own NCCL communicators, after the compute issued so far: they overlap with the
// backward of the earlier layers, and join() makes the compute stream wait for them before the
// optimizer reads the gradients. On CPU ranks (MPI, blocking) each sum runs at once.
#pragma once

#include <vector>

#include "core/tensor.h"
#include "parallel/groups.h"

namespace mop {

class GradReducer {
 public:
  explicit GradReducer(const ParallelGroups& groups);
  GradReducer(const GradReducer&) = delete;
  GradReducer& operator=(const GradReducer&) = delete;

  // Sums these gradients in place over the group along `replicas`, once the compute issued so far
  // has written them.
  void reduce(Axes replicas, const std::vector<Tensor>& grads);
  // The compute stream waits for every sum issued so far (nothing to do on the CPU).
  void join();
  bool overlapped() const { return overlapped_; }

 private:
  const ParallelGroups& groups_;
  bool overlapped_ = false;
};

}  // namespace mop
