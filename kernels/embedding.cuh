// Embedding lookup (bf16 rows gathered by token id) and its deterministic backward: token indices
// are sorted by id (CUB radix sort, stable), then each run of equal ids sums its rows in token
// order in fp32 and adds into the fp32 table gradient once. Ids outside [0, vocab) are not
// followed: the kernels set *error_flag (host-mapped pinned memory) instead, and the forward writes
// a zero row. Launchers take the destination first and the stream last and never allocate.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace mop::kernels {

// out[t] = table[ids[t]]: out [tokens, hidden], table [vocab, hidden], ids [tokens].
void embedding_fwd(__nv_bfloat16* out, const int32_t* ids, const __nv_bfloat16* table,
                   int64_t tokens, int64_t vocab, int64_t hidden, int* error_flag,
                   cudaStream_t stream);

// Device buffers of the backward, sized for up to `capacity` tokens.
struct EmbeddingBwdWorkspace {
  void* sort_temp = nullptr;  // CUB radix-sort temporary storage
  size_t sort_temp_bytes = 0;
  uint32_t* sorted_ids = nullptr;       // [capacity]
  int32_t* sorted_tokens = nullptr;     // [capacity]
  const int32_t* token_iota = nullptr;  // [capacity], token_iota[i] = i (written by embedding_iota)
  int32_t* long_runs = nullptr;         // [embedding_bwd_long_runs_size(capacity)]
  int64_t capacity = 0;
};

// Bytes of CUB sort storage the backward needs for `tokens` tokens.
size_t embedding_bwd_sort_bytes(int64_t tokens);
// Elements of EmbeddingBwdWorkspace::long_runs for `tokens` tokens (a count, then the start of
// every run of more than 16 tokens: at most tokens / 17 of them).
int64_t embedding_bwd_long_runs_size(int64_t tokens);
// x[i] = i for i < n (the sort's input values).
void embedding_iota(int32_t* x, int64_t n, cudaStream_t stream);

// dtable[ids[t]] += dout[t] for every token: dtable fp32 [vocab, hidden], dout bf16 [tokens,
// hidden].
void embedding_bwd(float* dtable, const int32_t* ids, const __nv_bfloat16* dout, int64_t tokens,
                   int64_t vocab, int64_t hidden, const EmbeddingBwdWorkspace& ws, int* error_flag,
                   cudaStream_t stream);

}  // namespace mop::kernels
