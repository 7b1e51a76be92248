// Helpers shared by the [gpu][moe] tests and bench_moe.cpp (no Catch2 here): routing inputs
// (distinct experts per token, optionally one expert left empty), route plans on either backend,
// bitwise comparison, and settle() — the uploads and poisoning of gpu_test_util.h run on the
// legacy default stream (cudaMemcpy from pageable memory and cudaMemset may return before the
// device is done), which CudaOps's non-blocking stream does not wait for, so callers synchronise
// the device before launching an op.
#pragma once

#ifdef MOP_HAVE_CUDA

#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "gpu/gpu_test_util.h"
#include "ops/ops_test_util.h"

namespace mop::test {

inline void settle() {
  MOP_CUDA_CHECK(cudaDeviceSynchronize());
}

// A CUDA build on a machine without a GPU runs an unfiltered mop_tests: these cases then pass
// with a note (`mop_tests "[gpu]"` exits 77 before any case runs).
inline bool skip_without_gpu() {
  if (gpu_available()) return false;
  std::fprintf(stderr, "no CUDA device: [gpu][moe] case skipped\n");
  return true;
}

// topk_idx [T,K] with K distinct experts per token drawn from [0, E) minus `skip` (-1: none).
inline HostTensor make_topk_idx(int64_t tokens, int64_t experts, int64_t top_k, uint64_t seed,
                                int32_t skip) {
  HostTensor idx(DType::I32, {tokens, top_k});
  std::vector<int32_t> pool;
  for (int64_t t = 0; t < tokens; ++t) {
    pool.clear();
    for (int32_t e = 0; e < experts; ++e)
      if (e != skip) pool.push_back(e);
    for (size_t i = pool.size(); i > 1; --i)
      std::swap(pool[i - 1], pool[philox_u64(seed, uint64_t(t), i) % i]);
    for (int64_t k = 0; k < top_k; ++k) idx.ptr<int32_t>()[t * top_k + k] = pool[size_t(k)];
  }
  return idx;
}

struct HostPlan {
  HostTensor counts, offsets, perm_src, slot_of;
  [[gnu::noinline]] HostPlan(int64_t tokens, int64_t experts, int64_t top_k)
      : counts(DType::I32, {experts}),
        offsets(DType::I32, {experts + 1}),
        perm_src(DType::I32, {tokens * top_k}),
        slot_of(DType::I32, {tokens * top_k}) {}
};

struct DevicePlan {
  DeviceTensor counts, offsets, perm_src, slot_of;
  [[gnu::noinline]] DevicePlan(int64_t tokens, int64_t experts, int64_t top_k)
      : counts(DType::I32, {experts}),
        offsets(DType::I32, {experts + 1}),
        perm_src(DType::I32, {tokens * top_k}),
        slot_of(DType::I32, {tokens * top_k}) {}
};

inline HostPlan cpu_route_plan(const HostTensor& topk_idx, int64_t experts) {
  HostPlan p(topk_idx.t.shape[0], experts, topk_idx.t.shape[1]);
  make_cpu_ops()->moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, topk_idx);
  return p;
}

// The route plan on the GPU, every output poisoned first.
inline DevicePlan gpu_route_plan(Ops& ops, const DeviceTensor& topk_idx, int64_t experts) {
  DevicePlan p(topk_idx.t.shape[0], experts, topk_idx.t.shape[1]);
  for (const DeviceTensor* t : {&p.counts, &p.offsets, &p.perm_src, &p.slot_of}) poison(*t);
  settle();
  ops.moe_route_plan(p.counts, p.offsets, p.perm_src, p.slot_of, topk_idx);
  return p;
}

}  // namespace mop::test

#endif  // MOP_HAVE_CUDA
