// GradReducer (see grad_reducer.h).
#include "parallel/grad_reducer.h"

namespace mop {

GradReducer::GradReducer(ParallelGroups& groups)
    : dense_(groups.world_data.get()), expert_(groups.edp_data.get()) {
  if (groups.world_grad && groups.edp_grad) {  // asynchronous comms on their own stream
    dense_ = groups.world_grad.get(), expert_ = groups.edp_grad.get();
    overlapped_ = true;
  }
}

void GradReducer::reduce(const std::vector<Tensor>& dense, const std::vector<Tensor>& expert) {
  for (const Tensor& t : dense) dense_->all_reduce_sum(t);
  for (const Tensor& t : expert) expert_->all_reduce_sum(t);
}

void GradReducer::join() {
  dense_->join();
  expert_->join();
}

}  // namespace mop
