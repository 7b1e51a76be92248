// CUDA backend, gemm stem: the dense GEMM on cuBLASLt (gemm_lt.h), and the GEMM family's state
// (gemm_state.h): its creation, preparation and size.
#include "ops/cuda/backend.h"
#include "ops/cuda/gemm_state.h"

namespace mop {

void GemmStateDeleter::operator()(GemmState* s) const {
  delete s;
}

GemmState& CudaBackend::gemm_state() {
  if (!gemm_) gemm_.reset(new GemmState(stream_));
  return *gemm_;
}

void CudaBackend::prepare_gemm(const OpShapes& shapes) {
  GemmState& st = gemm_state();
  if (shapes.experts > 0) st.reserve_groups(shapes.experts);
  if (shapes.lm_head_chunk > 0 && shapes.vocab > 0)
    st.reserve_dlogits(shapes.lm_head_chunk * shapes.vocab);
}

size_t CudaBackend::gemm_workspace_bytes() const {
  return gemm_ ? gemm_->bytes() : 0;
}

void CudaBackend::gemm(Tensor c, const Tensor& a, bool trans_a, const Tensor& b, bool trans_b,
                   float alpha, float beta) {
  const int64_t m = trans_a ? a.shape[1] : a.shape[0];
  const int64_t k = trans_a ? a.shape[0] : a.shape[1];
  const int64_t n = trans_b ? b.shape[0] : b.shape[1];
  GemmState& st = gemm_state();
  st.lt.run({c.data, c.dtype, a.data, trans_a, b.data, trans_b, m, n, k, alpha, beta}, st.lane());
}

}  // namespace mop
