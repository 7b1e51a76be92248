// GradReducer (see grad_reducer.h).
#include "parallel/grad_reducer.h"

namespace mop {

GradReducer::GradReducer(const ParallelGroups& groups)
    : groups_(groups),
      // Asynchronous comms on their own stream (GPU ranks with parallel.overlap_grad_reduce).
      overlapped_(groups.side(CommKind::GradSums, kDenseReplicas) &&
                  groups.side(CommKind::GradSums, kExpertReplicas)) {}

void GradReducer::reduce(Axes replicas, const std::vector<Tensor>& grads) {
  Comm& comm = overlapped_ ? *groups_.side(CommKind::GradSums, replicas) : groups_.data(replicas);
  for (const Tensor& t : grads) comm.all_reduce_sum(t);
}

void GradReducer::join() {
  if (overlapped_) return groups_.join(CommKind::GradSums);
  groups_.data(kDenseReplicas).join();
  groups_.data(kExpertReplicas).join();
}

}  // namespace mop
