// GradReducer (see grad_reducer.h).
#include "parallel/grad_reducer.h"

#include "ops/ops.h"

#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>

#include "core/cuda_check.h"
#include "ops/cuda_ops.h"
#endif

namespace mop {

GradReducer::GradReducer(ParallelGroups& groups, Ops& ops)
    : dense_(groups.world_data.get()), expert_(groups.edp_data.get()) {
#ifdef MOP_HAVE_CUDA
  if (groups.grad_stream && groups.world_grad && groups.edp_grad) {
    compute_ = cuda_backend(ops, "a side stream for gradient sums").stream();
    side_ = groups.grad_stream;
    dense_ = groups.world_grad.get(), expert_ = groups.edp_grad.get();
    cudaEvent_t a, b;
    MOP_CUDA_CHECK(cudaEventCreateWithFlags(&a, cudaEventDisableTiming));
    MOP_CUDA_CHECK(cudaEventCreateWithFlags(&b, cudaEventDisableTiming));
    ready_ = a, done_ = b;
  }
#else
  (void)ops;
#endif
}

GradReducer::~GradReducer() {
#ifdef MOP_HAVE_CUDA
  if (ready_) cudaEventDestroy(static_cast<cudaEvent_t>(ready_));
  if (done_) cudaEventDestroy(static_cast<cudaEvent_t>(done_));
#endif
}

void GradReducer::reduce(const std::vector<Tensor>& dense, const std::vector<Tensor>& expert) {
  if (dense.empty() && expert.empty()) return;
#ifdef MOP_HAVE_CUDA
  if (side_) {
    auto compute = static_cast<cudaStream_t>(compute_), side = static_cast<cudaStream_t>(side_);
    MOP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(ready_), compute));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(side, static_cast<cudaEvent_t>(ready_), 0));
  }
#endif
  for (const Tensor& t : dense) dense_->all_reduce_sum(t);
  for (const Tensor& t : expert) expert_->all_reduce_sum(t);
#ifdef MOP_HAVE_CUDA
  if (side_)
    MOP_CUDA_CHECK(cudaEventRecord(static_cast<cudaEvent_t>(done_), static_cast<cudaStream_t>(side_)));
#endif
}

void GradReducer::join() {
#ifdef MOP_HAVE_CUDA
  if (side_)
    MOP_CUDA_CHECK(cudaStreamWaitEvent(static_cast<cudaStream_t>(compute_), static_cast<cudaEvent_t>(done_), 0));
#endif
}

}  // namespace mop
