// Front of the embedding lookup and its backward: their checks, then the backend's hooks
// (cpu/embedding.cpp, cuda/embedding.cpp, kernels/embedding.cu). Ids are range-checked by the
// backends (the CPU reads them; the GPU flags them on the device).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {

void Ops::embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) {
  MOP_CHECK(table.ndim == 2, "embedding_fwd: table must be [V,H], is ", table.shape_str());
  MOP_CHECK(ids.ndim == 1, "embedding_fwd: ids must be [T], is ", ids.shape_str());
  const DType dt = compute_dtype(table, "embedding_fwd: table");
  const int64_t vocab = table.shape[0], hidden = table.shape[1], tokens = ids.shape[0];
  expect(ids, "embedding_fwd: ids", DType::I32, {tokens});
  expect(table, "embedding_fwd: table", dt, {vocab, hidden});
  expect(out, "embedding_fwd: out", dt, {tokens, hidden});
  run(OpId::embedding_fwd, &OpsBackend::embedding_fwd, out, ids, table);
}

void Ops::embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) {
  MOP_CHECK(dtable.ndim == 2, "embedding_bwd: dtable must be [V,H], is ", dtable.shape_str());
  MOP_CHECK(ids.ndim == 1, "embedding_bwd: ids must be [T], is ", ids.shape_str());
  const DType dt = compute_dtype(dout, "embedding_bwd: dout");
  const int64_t vocab = dtable.shape[0], hidden = dtable.shape[1], tokens = ids.shape[0];
  expect(ids, "embedding_bwd: ids", DType::I32, {tokens});
  expect(dtable, "embedding_bwd: dtable", acc_dtype(dt), {vocab, hidden});
  expect(dout, "embedding_bwd: dout", dt, {tokens, hidden});
  run(OpId::embedding_bwd, &OpsBackend::embedding_bwd, dtable, ids, dout);
}

}  // namespace mop
