// CPU reference: the embedding lookup (a row copy per token, ids checked against the vocabulary)
// and its backward (rows added into the table in token order).
#include <cstring>

#include "ops/cpu/cpu.h"

namespace mop::cpu {

void CpuBackend::embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) {
  const DType dt = table.dtype;
  const int64_t vocab = table.shape[0], hidden = table.shape[1], num_tokens = ids.shape[0];
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    MOP_CHECK(id[t] >= 0 && id[t] < vocab, "embedding_fwd: ids[", t, "] = ", id[t], " outside [0, ",
              vocab, ")");
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
      std::memcpy(out.ptr<T>() + t * hidden, table.ptr<T>() + id[t] * hidden,
                  size_t(hidden) * sizeof(T));
  });
}

void CpuBackend::embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) {
  const DType dt = dout.dtype;
  const int64_t vocab = dtable.shape[0], hidden = dtable.shape[1], num_tokens = ids.shape[0];
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    MOP_CHECK(id[t] >= 0 && id[t] < vocab, "embedding_bwd: ids[", t, "] = ", id[t], " outside [0, ",
              vocab, ")");
  // Tokens add into the table in token order; repeated ids make a parallel loop over tokens racy,
  // and T·H additions are cheap next to the rest of the step.
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < num_tokens; ++t) {
      T* dst = dtable.ptr<T>() + id[t] * hidden;
      const T* src = dout.ptr<T>() + t * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] += src[c];
    }
  });
}

}  // namespace mop::cpu
