// CUDA backend, lmhead stem: the fused LM head + cross-entropy — cuBLASLt logits per chunk of
// tokens into the fp32 workspace, then the loss / dlogits kernels (kernels/lmhead.cu), then
// dx and dw from the chunk's bf16 dlogits.
#include <cuda_bf16.h>

#include <algorithm>

#include "kernels/lmhead.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/gemm_state.h"

namespace mop {
namespace {

struct LmHeadShape {
  int64_t tokens, hidden, vocab, chunk;
};

LmHeadShape shape_of(const Tensor& x, const Tensor& w, const Tensor& workspace) {
  return {x.shape[0], x.shape[1], w.shape[0], workspace.shape[0]};
}

// logits[rows,V] (fp32, the workspace) = x[t0 : t0+rows] · wᵀ.
GemmCall chunk_logits(const Tensor& workspace, const Tensor& x, const Tensor& w, int64_t t0,
                      int64_t rows, const LmHeadShape& s) {
  return {workspace.data,
          DType::F32,
          elem(x, t0 * s.hidden),
          false,
          w.data,
          true,
          rows,
          s.vocab,
          s.hidden,
          1,
          0};
}

// The gradient passes, with the forward's too when `loss` is given (each chunk's logits computed
// once; the same kernels and GEMMs as forward then backward, so the same bits).
void run_lmhead(GemmState& st, cudaStream_t stream, Tensor* loss, Tensor lse, Tensor dx, Tensor dw,
                const Tensor& x, const Tensor& w, const Tensor& targets, float grad_scale,
                Tensor workspace) {
  const LmHeadShape s = shape_of(x, w, workspace);
  if (s.tokens == 0) return;
  st.reserve_dlogits(std::min(s.chunk, s.tokens) * s.vocab);
  auto* dlogits = static_cast<__nv_bfloat16*>(st.dlogits.data());
  for (int64_t t0 = 0; t0 < s.tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.tokens - t0);
    st.lt.run(chunk_logits(workspace, x, w, t0, rows, s), st.lane());
    if (loss)
      kernels::cross_entropy_fwd(loss->ptr<float>() + t0, lse.ptr<float>() + t0,
                                 workspace.ptr<float>(), targets.ptr<int32_t>() + t0, rows,
                                 s.vocab, stream);
    kernels::cross_entropy_bwd(dlogits, workspace.ptr<float>(), lse.ptr<float>() + t0,
                               targets.ptr<int32_t>() + t0, grad_scale, rows, s.vocab, stream);
    // dx[chunk] = dlogits[rows,V] · w[V,H] (overwrite);  dw[V,H] += dlogits[rows,V]ᵀ · x[chunk].
    st.lt.run({elem(dx, t0 * s.hidden), DType::BF16, dlogits, false, w.data, false, rows, s.hidden,
               s.vocab, 1, 0},
              st.lane());
    st.lt.run({dw.data, DType::F32, dlogits, true, elem(x, t0 * s.hidden), false, s.vocab,
               s.hidden, rows, 1, 1},
              st.lane());
  }
}

}  // namespace

void CudaBackend::lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                            const Tensor& targets, Tensor workspace) {
  const LmHeadShape s = shape_of(x, w, workspace);
  GemmState& st = gemm_state();
  for (int64_t t0 = 0; t0 < s.tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.tokens - t0);
    st.lt.run(chunk_logits(workspace, x, w, t0, rows, s), st.lane());
    kernels::cross_entropy_fwd(loss.ptr<float>() + t0, lse.ptr<float>() + t0,
                               workspace.ptr<float>(), targets.ptr<int32_t>() + t0, rows, s.vocab,
                               stream_);
  }
}

void CudaBackend::lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
                            const Tensor& targets, const Tensor& lse, float grad_scale,
                            Tensor workspace) {
  run_lmhead(gemm_state(), stream_, nullptr, lse, dx, dw, x, w, targets, grad_scale, workspace);
}

void CudaBackend::lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                                const Tensor& w, const Tensor& targets, float grad_scale,
                                Tensor workspace) {
  run_lmhead(gemm_state(), stream_, &loss, lse, dx, dw, x, w, targets, grad_scale,
             workspace);
}

}  // namespace mop
