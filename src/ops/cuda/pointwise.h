// Internal to the CUDA backend: the device state of the pointwise stems (elementwise, embedding,
// rmsnorm, rope) — reduction partials, RMSNorm dw partials, the embedding backward's sort
// buffers, RoPE inverse-frequency tables, the id-error flag — created by
// CudaBackend::pointwise_state() and sized by prepare from OpShapes, or on first use when an op
// runs unprepared (tests); and the helpers those stems share.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "core/tensor.h"
#include "runtime/memory.h"

namespace mop {

// Distinct (theta, head dim) pairs whose RoPE tables stay cached.
constexpr int kRopeSlots = 8;

struct PointwiseState {
  Buffer reduce_partials;  // device [kReduceMaxBlocks]: a double each (sum), 4 words (sumsq)
  Buffer dw_partials;      // device float, rmsnorm_bwd's per-block dw partials
  // embedding_bwd, for up to embed_capacity tokens
  Buffer sort_temp, sorted_ids, sorted_tokens, token_iota, long_runs;
  int64_t embed_capacity = 0;
  // RoPE inv_freq tables: float [kRopeSlots][kRopeMaxHalfDim], pinned host copy and device copy.
  // A slot's pinned half is written once, before its one upload, so no queued copy reads a
  // changing source (reusing a slot waits for the stream first).
  struct RopeSlot {
    uint32_t theta_bits = 0;
    int64_t dim = 0;
    bool used = false;
  };
  Buffer rope_host, rope_device;
  RopeSlot rope_slots[kRopeSlots];
  int rope_next_victim = 0;
  // Set by the embedding kernels when an id lies outside [0, vocab): pinned host memory that the
  // device writes directly (mapped), so checking it needs no synchronisation.
  Buffer id_error;
  int* id_error_device = nullptr;  // the same memory as seen by kernels
};


// Grows `buf` to at least `bytes`. An existing allocation may still be in use by queued work, so
// the stream drains before it is freed; prepared runs never get here (prepare sized everything).
void reserve(Buffer& buf, MemKind kind, size_t bytes, cudaStream_t stream);
// The embedding backward's buffers for `tokens` tokens (embedding.cpp).
void reserve_embedding(PointwiseState& s, int64_t tokens, cudaStream_t stream);

inline __nv_bfloat16* bf16_ptr(const Tensor& t) {
  return static_cast<__nv_bfloat16*>(t.data);
}

}  // namespace mop
