// CPU reference: fused LM head + cross-entropy, chunked over tokens. Each chunk of C tokens gets
// its logits [C,V] in the workspace (the full [T,V] never exists); forward keeps per-token lse and
// loss, backward recomputes the chunk's logits and turns them into dlogits in place, and the
// training form does both from one computation of each chunk's logits.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/gemm.h"
#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

struct LmHeadShape {
  int64_t num_tokens, hidden, vocab, chunk;
};

// The shapes (checked by the front) and the targets, which must lie below the vocabulary (< 0:
// masked).
LmHeadShape check_shapes(const Tensor& x, const Tensor& w, const Tensor& targets,
                         const Tensor& workspace, const char* op) {
  LmHeadShape s{x.shape[0], x.shape[1], w.shape[0], workspace.shape[0]};
  const int32_t* tg = targets.ptr<int32_t>();
  for (int64_t t = 0; t < s.num_tokens; ++t)
    MOP_CHECK(tg[t] < s.vocab, op, ": targets[", t, "] = ", tg[t], " ≥ vocabulary ", s.vocab);
  return s;
}

// ws[0..rows) = x[t0..t0+rows) · wᵀ, with wt = wᵀ [H,V] packed once per call.
template <class T>
void chunk_logits(T* ws, const T* x, const std::vector<T>& wt, int64_t t0, int64_t rows,
                  const LmHeadShape& s) {
  gemm_nn(ws, x + t0 * s.hidden, wt.data(), rows, s.vocab, s.hidden, T(1), T(0));
}

// lse and loss of chunk row r (logits z, the whole row). The whole row is in the workspace, so the
// two-pass form (max, then Σ exp) is exact enough and simpler than an online update.
template <class T>
void row_lse_loss(const T* z, int32_t target, int64_t vocab, T* lse, T* loss) {
  T m = z[0];
  for (int64_t v = 1; v < vocab; ++v) m = std::max(m, z[v]);
  T l = 0;
  for (int64_t v = 0; v < vocab; ++v) l += std::exp(z[v] - m);
  const T row_lse = m + std::log(l);
  *lse = row_lse;
  *loss = target < 0 ? T(0) : row_lse - z[target];
}

// z = dlogits = (softmax − onehot(target)) · grad_scale, in place; masked rows contribute nothing.
template <class T>
void row_dlogits(T* z, int32_t target, T row_lse, T grad_scale, int64_t vocab) {
  if (target < 0) {
    std::fill(z, z + vocab, T(0));
    return;
  }
  for (int64_t v = 0; v < vocab; ++v) {
    const T p = std::exp(z[v] - row_lse);
    z[v] = (v == target ? p - T(1) : p) * grad_scale;
  }
}

// dx[chunk] = dlogits · w (overwrite);  dw += dlogitsᵀ · x[chunk].
template <class T>
void chunk_grads(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const T* dlogits,
                 std::vector<T>& dlogits_t, int64_t t0, int64_t rows, const LmHeadShape& s) {
  gemm_nn(dx.ptr<T>() + t0 * s.hidden, dlogits, w.ptr<T>(), rows, s.hidden, s.vocab, T(1), T(0));
  dlogits_t.resize(size_t(s.vocab * rows));
  transpose(dlogits_t.data(), dlogits, rows, s.vocab);
  gemm_nn(dw.ptr<T>(), dlogits_t.data(), x.ptr<T>() + t0 * s.hidden, s.vocab, s.hidden, rows,
          T(1), T(1));
}

// Forward (loss, lse), backward (dx, dw from the saved lse, recomputing the logits), or both at
// once (the logits of a chunk computed once): the same per-row arithmetic in every mode, so the
// fused mode equals forward then backward bit for bit.
enum class Mode { Forward, Backward, Both };

template <class T>
void lmhead_impl(Mode mode, Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                 const Tensor& w, const Tensor& targets, T grad_scale, Tensor workspace,
                 const LmHeadShape& s) {
  std::vector<T> wt(size_t(s.vocab * s.hidden)), dlogits_t;
  transpose(wt.data(), w.ptr<T>(), s.vocab, s.hidden);
  T* ws = workspace.ptr<T>();
  const int32_t* tg = targets.ptr<int32_t>();
  for (int64_t t0 = 0; t0 < s.num_tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.num_tokens - t0);
    chunk_logits(ws, x.ptr<T>(), wt, t0, rows, s);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* z = ws + r * s.vocab;
      if (mode != Mode::Backward)
        row_lse_loss(z, tg[t0 + r], s.vocab, lse.ptr<T>() + t0 + r, loss.ptr<T>() + t0 + r);
      if (mode != Mode::Forward) row_dlogits(z, tg[t0 + r], lse.ptr<T>()[t0 + r], grad_scale, s.vocab);
    }
    if (mode != Mode::Forward) chunk_grads(dx, dw, x, w, ws, dlogits_t, t0, rows, s);
  }
}

}  // namespace

void CpuBackend::lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                               const Tensor& targets, Tensor workspace) {
  const LmHeadShape s = check_shapes(x, w, targets, workspace, "lmhead_ce_fwd");
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    lmhead_impl<T>(Mode::Forward, loss, lse, {}, {}, x, w, targets, T(0), workspace, s);
  });
}

void CpuBackend::lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w,
                               const Tensor& targets, const Tensor& lse, float grad_scale,
                               Tensor workspace) {
  const LmHeadShape s = check_shapes(x, w, targets, workspace, "lmhead_ce_bwd");
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    lmhead_impl<T>(Mode::Backward, {}, lse, dx, dw, x, w, targets, T(grad_scale), workspace, s);
  });
}

void CpuBackend::lmhead_ce_fwd_bwd(Tensor loss, Tensor lse, Tensor dx, Tensor dw, const Tensor& x,
                                   const Tensor& w, const Tensor& targets, float grad_scale,
                                   Tensor workspace) {
  const LmHeadShape s = check_shapes(x, w, targets, workspace, "lmhead_ce_fwd_bwd");
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    lmhead_impl<T>(Mode::Both, loss, lse, dx, dw, x, w, targets, T(grad_scale), workspace, s);
  });
}

}  // namespace mop::cpu
