// Front of the merge of a partial attention result into an accumulator (ring attention): the
// checks, then the backend's hook (cpu/attention_merge.cpp, cuda/attention_merge.cpp,
// kernels/attention_merge.cu).
#include "core/error.h"
#include "ops/ops.h"

namespace mop {

void Ops::attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o, const Tensor& lse,
                          int batch) {
  MOP_CHECK(o.ndim == 3 && batch > 0 && o.shape[0] % batch == 0, "attention_merge: o ",
            o.shape_str(), " is not [T,Nq,D] of ", batch, " sequences");
  const DType dt = compute_dtype(o, "attention_merge: o");
  const int64_t rows = o.shape[0], heads = o.shape[1], dim = o.shape[2], seq = rows / batch;
  expect(o, "attention_merge: o", dt, {rows, heads, dim});
  expect(out_acc, "attention_merge: out_acc", acc_dtype(dt), {rows, heads, dim});
  expect(lse_acc, "attention_merge: lse_acc", acc_dtype(dt), {batch, heads, seq});
  expect(lse, "attention_merge: lse", acc_dtype(dt), {batch, heads, seq});
  run(OpId::attention_merge, &OpsBackend::attention_merge, out_acc, lse_acc, o, lse, batch);
}

}  // namespace mop
