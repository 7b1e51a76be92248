// CUDA backend, embedding stem: the lookup and its backward (kernels/embedding.cu; a sort of the
// ids groups the rows each table row receives). Ids outside [0, vocab) are flagged by the kernels
// in mapped host memory and reported at the next embedding call.
#include <algorithm>

#include "kernels/embedding.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/pointwise.h"
#include "runtime/cuda_check.h"

namespace mop {

void reserve_embedding(PointwiseState& s, int64_t tokens, cudaStream_t stream) {
  const size_t sort_bytes = kernels::embedding_bwd_sort_bytes(tokens);
  if (tokens <= s.embed_capacity && sort_bytes <= s.sort_temp.bytes()) return;
  const int64_t capacity = std::max(tokens, s.embed_capacity);
  const size_t index_bytes = size_t(capacity) * sizeof(int32_t);
  reserve(s.sort_temp, MemKind::Device, kernels::embedding_bwd_sort_bytes(capacity), stream);
  reserve(s.sorted_ids, MemKind::Device, index_bytes, stream);
  reserve(s.sorted_tokens, MemKind::Device, index_bytes, stream);
  reserve(s.token_iota, MemKind::Device, index_bytes, stream);
  reserve(s.long_runs, MemKind::Device,
          size_t(kernels::embedding_bwd_long_runs_size(capacity)) * sizeof(int32_t), stream);
  kernels::embedding_iota(static_cast<int32_t*>(s.token_iota.data()), capacity, stream);
  s.embed_capacity = capacity;
}

namespace {

// The ids of an earlier embedding call, checked on the device, were out of range: report it now
// (an op may not wait for the device, so the error surfaces at the next embedding call).
void check_embedding_ids(PointwiseState& s) {
  volatile int* flag = static_cast<volatile int*>(s.id_error.data());
  if (*flag == 0) return;
  *flag = 0;
  MOP_CHECK(false,
            "embedding: a token id outside [0, vocab) reached an earlier embedding_fwd/bwd "
            "on the device (the data loader should have rejected it)");
}

}  // namespace

// ---- embedding --------------------------------------------------------------------------------

void CudaBackend::embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) {
  const int64_t vocab = table.shape[0], hidden = table.shape[1], tokens = ids.shape[0];
  PointwiseState& s = pointwise_state();
  check_embedding_ids(s);
  kernels::embedding_fwd(bf16_ptr(out), ids.ptr<int32_t>(), bf16_ptr(table), tokens, vocab, hidden,
                         s.id_error_device, stream_);
}

void CudaBackend::embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) {
  const int64_t vocab = dtable.shape[0], hidden = dtable.shape[1], tokens = ids.shape[0];
  PointwiseState& s = pointwise_state();
  check_embedding_ids(s);
  if (tokens == 0) return;
  reserve_embedding(s, tokens, stream_);
  kernels::EmbeddingBwdWorkspace ws;
  ws.sort_temp = s.sort_temp.data();
  ws.sort_temp_bytes = s.sort_temp.bytes();
  ws.sorted_ids = static_cast<uint32_t*>(s.sorted_ids.data());
  ws.sorted_tokens = static_cast<int32_t*>(s.sorted_tokens.data());
  ws.token_iota = static_cast<const int32_t*>(s.token_iota.data());
  ws.long_runs = static_cast<int32_t*>(s.long_runs.data());
  ws.capacity = s.embed_capacity;
  kernels::embedding_bwd(dtable.ptr<float>(), ids.ptr<int32_t>(), bf16_ptr(dout), tokens, vocab,
                         hidden, ws, s.id_error_device, stream_);
}

}  // namespace mop
