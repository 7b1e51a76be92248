// CPU reference: fused LM head + cross-entropy, chunked over tokens. Each chunk of C tokens gets
// its logits [C,V] in the workspace (the full [T,V] never exists); forward keeps per-token lse and
// loss, backward recomputes the chunk's logits and turns them into dlogits in place.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu_gemm.h"
#include "ops/cpu_ops.h"

namespace mop::cpu {
namespace {

struct LmHeadShape {
  int64_t num_tokens, hidden, vocab, chunk;
};

LmHeadShape check_shapes(const Tensor& x, const Tensor& w, const Tensor& targets,
                         const Tensor& workspace, const char* op) {
  DType dt = compute_dtype(x, op);
  MOP_CHECK(x.ndim == 2 && w.ndim == 2 && workspace.ndim == 2, op, ": x ", x.shape_str(), ", w ",
            w.shape_str(), ", workspace ", workspace.shape_str());
  LmHeadShape s{x.shape[0], x.shape[1], w.shape[0], workspace.shape[0]};
  MOP_CHECK(s.chunk >= 1, op, ": the workspace holds no rows");
  expect(x, "lmhead_ce: x", dt, {s.num_tokens, s.hidden});
  expect(w, "lmhead_ce: w", dt, {s.vocab, s.hidden});
  expect(workspace, "lmhead_ce: workspace", acc_dtype(dt), {s.chunk, s.vocab});
  expect(targets, "lmhead_ce: targets", DType::I32, {s.num_tokens});
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

template <class T>
void lmhead_fwd_impl(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w,
                     const Tensor& targets, Tensor workspace, const LmHeadShape& s) {
  std::vector<T> wt(size_t(s.vocab * s.hidden));
  transpose(wt.data(), w.ptr<T>(), s.vocab, s.hidden);
  T* ws = workspace.ptr<T>();
  for (int64_t t0 = 0; t0 < s.num_tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.num_tokens - t0);
    chunk_logits(ws, x.ptr<T>(), wt, t0, rows, s);
    // The whole row is in the workspace, so the two-pass form (max, then Σ exp) is exact enough
    // and simpler than an online update.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* z = ws + r * s.vocab;
      T m = z[0];
      for (int64_t v = 1; v < s.vocab; ++v) m = std::max(m, z[v]);
      T l = 0;
      for (int64_t v = 0; v < s.vocab; ++v) l += std::exp(z[v] - m);
      const T row_lse = m + std::log(l);
      const int32_t target = targets.ptr<int32_t>()[t0 + r];
      lse.ptr<T>()[t0 + r] = row_lse;
      loss.ptr<T>()[t0 + r] = target < 0 ? T(0) : row_lse - z[target];
    }
  }
}

template <class T>
void lmhead_bwd_impl(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const Tensor& targets,
                     const Tensor& lse, T grad_scale, Tensor workspace, const LmHeadShape& s) {
  std::vector<T> wt(size_t(s.vocab * s.hidden)), dlogits_t;
  transpose(wt.data(), w.ptr<T>(), s.vocab, s.hidden);
  T* ws = workspace.ptr<T>();
  for (int64_t t0 = 0; t0 < s.num_tokens; t0 += s.chunk) {
    const int64_t rows = std::min(s.chunk, s.num_tokens - t0);
    chunk_logits(ws, x.ptr<T>(), wt, t0, rows, s);
    // dlogits = (softmax − onehot(target)) · grad_scale; masked rows contribute nothing.
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      T* z = ws + r * s.vocab;
      const int32_t target = targets.ptr<int32_t>()[t0 + r];
      if (target < 0) {
        std::fill(z, z + s.vocab, T(0));
        continue;
      }
      const T row_lse = lse.ptr<T>()[t0 + r];
      for (int64_t v = 0; v < s.vocab; ++v) {
        const T p = std::exp(z[v] - row_lse);
        z[v] = (v == target ? p - T(1) : p) * grad_scale;
      }
    }
    // dx[chunk] = dlogits · w (overwrite);  dw += dlogitsᵀ · x[chunk].
    gemm_nn(dx.ptr<T>() + t0 * s.hidden, ws, w.ptr<T>(), rows, s.hidden, s.vocab, T(1), T(0));
    dlogits_t.resize(size_t(s.vocab * rows));
    transpose(dlogits_t.data(), ws, rows, s.vocab);
    gemm_nn(dw.ptr<T>(), dlogits_t.data(), x.ptr<T>() + t0 * s.hidden, s.vocab, s.hidden, rows,
            T(1), T(1));
  }
}

}  // namespace

void lmhead_ce_fwd(Tensor loss, Tensor lse, const Tensor& x, const Tensor& w, const Tensor& targets,
                   Tensor workspace) {
  LmHeadShape s = check_shapes(x, w, targets, workspace, "lmhead_ce_fwd");
  expect(loss, "lmhead_ce_fwd: loss", acc_dtype(x.dtype), {s.num_tokens});
  expect(lse, "lmhead_ce_fwd: lse", acc_dtype(x.dtype), {s.num_tokens});
  MOP_CHECK(s.vocab > 0, "lmhead_ce_fwd: empty vocabulary");
  dispatch_float(x.dtype, [&](auto tag) {
    lmhead_fwd_impl<decltype(tag)>(loss, lse, x, w, targets, workspace, s);
  });
}

void lmhead_ce_bwd(Tensor dx, Tensor dw, const Tensor& x, const Tensor& w, const Tensor& targets,
                   const Tensor& lse, float grad_scale, Tensor workspace) {
  LmHeadShape s = check_shapes(x, w, targets, workspace, "lmhead_ce_bwd");
  expect(dx, "lmhead_ce_bwd: dx", x.dtype, {s.num_tokens, s.hidden});
  expect(dw, "lmhead_ce_bwd: dw", x.dtype, {s.vocab, s.hidden});
  expect(lse, "lmhead_ce_bwd: lse", acc_dtype(x.dtype), {s.num_tokens});
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    lmhead_bwd_impl<T>(dx, dw, x, w, targets, lse, T(grad_scale), workspace, s);
  });
}

}  // namespace mop::cpu
