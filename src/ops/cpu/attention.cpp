// CPU reference: GQA attention (causal, or full for ring attention's off-diagonal blocks), forward
// (saving the log-sum-exp per query) and backward (dS = P ⊙ (dP − rowsum(dO ⊙ O)), P recomputed
// from the saved lse), as GEMMs over blocks of query rows. Forward runs one task per (sequence, query head); backward one per (sequence, kv head),
// looping over that head's query heads in order, so dk/dv sums have one fixed order and no two
// threads write the same element: results do not depend on the thread count.
#include <algorithm>
#include <cmath>
#include <vector>

#include "ops/cpu/gemm.h"
#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

// q, k, v, out rows are tokens t = b·S + s; head h of token t starts at (t·heads + h)·D.
struct AttnShape {
  int64_t batch, seq, num_q_heads, num_kv_heads, head_dim;
  int64_t group() const { return num_q_heads / num_kv_heads; }
};

AttnShape shape_of(const Tensor& q, const Tensor& k, int batch) {
  return {batch, q.shape[0] / batch, q.shape[1], k.shape[1], q.shape[2]};
}

// Query rows per block: scores of a block against its keys are one GEMM ([rows,D]·[D,n]); a causal
// block wastes at most half of its diagonal square on masked scores (≤ 12% at S = 256).
constexpr int64_t kQueryBlock = 32;

// kt[d·S + j] = x[b·S + j, g, d]: one kv head of one sequence, transposed into the [D,S] operand
// of the score GEMMs.
template <class T>
void pack_head_transposed(std::vector<T>& kt, const T* x, const AttnShape& s, int64_t b,
                          int64_t g) {
  kt.resize(size_t(s.head_dim * s.seq));
  for (int64_t j = 0; j < s.seq; ++j) {
    const T* row = x + ((b * s.seq + j) * s.num_kv_heads + g) * s.head_dim;
    for (int64_t d = 0; d < s.head_dim; ++d) kt[size_t(d * s.seq + j)] = row[d];
  }
}

// dst[j·rows + r] = src[r·n + j]: a [rows,n] block transposed for the dK/dV GEMMs.
template <class T>
void transpose_block(std::vector<T>& dst, const std::vector<T>& src, int64_t rows, int64_t n) {
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t j = 0; j < n; ++j) dst[size_t(j * rows + r)] = src[size_t(r * n + j)];
}

// Forward, one task per (sequence, query head). Per block of query rows i0..i0+rows, with
// n = i0 + rows keys (causal) or all S:  S = scale·Q·Kᵀ, P = exp(S − rowmax) (causal: 0 where j > i),
// O = P·V / rowsum(P), lse = rowmax + log rowsum(P).
template <class T>
void attention_fwd_impl(Tensor out, Tensor lse, const Tensor& q, const Tensor& k, const Tensor& v,
                        const AttnShape& s, T scale, bool causal) {
  const int64_t dim = s.head_dim, ldq = s.num_q_heads * dim, ldkv = s.num_kv_heads * dim;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < s.batch * s.num_q_heads; ++task) {
    const int64_t b = task / s.num_q_heads, h = task % s.num_q_heads, g = h / s.group();
    const T* q_bh = q.ptr<T>() + b * s.seq * ldq + h * dim;
    const T* v_bg = v.ptr<T>() + b * s.seq * ldkv + g * dim;
    T* o_bh = out.ptr<T>() + b * s.seq * ldq + h * dim;
    T* lse_bh = lse.ptr<T>() + (b * s.num_q_heads + h) * s.seq;
    std::vector<T> kt, p(static_cast<size_t>(kQueryBlock * s.seq));
    std::vector<T> row_sum(static_cast<size_t>(kQueryBlock));
    pack_head_transposed(kt, k.ptr<T>(), s, b, g);
    for (int64_t i0 = 0; i0 < s.seq; i0 += kQueryBlock) {
      const int64_t rows = std::min(kQueryBlock, s.seq - i0), n = causal ? i0 + rows : s.seq;
      gemm_nn(p.data(), n, q_bh + i0 * ldq, ldq, kt.data(), s.seq, rows, n, dim, scale, T(0));
      for (int64_t r = 0; r < rows; ++r) {
        T* pr = p.data() + r * n;
        const int64_t visible = causal ? i0 + r + 1 : n;  // causal: keys 0..i
        T m = pr[0];
        for (int64_t j = 1; j < visible; ++j) m = std::max(m, pr[j]);
        T l = 0;
        for (int64_t j = 0; j < visible; ++j) {
          pr[j] = std::exp(pr[j] - m);
          l += pr[j];
        }
        std::fill(pr + visible, pr + n, T(0));
        row_sum[size_t(r)] = l;
        lse_bh[i0 + r] = m + std::log(l);
      }
      gemm_nn(o_bh + i0 * ldq, ldq, p.data(), n, v_bg, ldkv, rows, dim, n, T(1), T(0));
      for (int64_t r = 0; r < rows; ++r)
        for (int64_t d = 0; d < dim; ++d) o_bh[(i0 + r) * ldq + d] /= row_sum[size_t(r)];
    }
  }
}

// Backward, one task per (sequence, kv head), looping over its query heads and query blocks in
// order. With P = exp(S − lse) recomputed, dP = dO·Vᵀ and delta = rowsum(dO ⊙ O):
// dS = P ⊙ (dP − delta), dQ = scale·dS·K, dK += scale·dSᵀ·Q, dV += Pᵀ·dO.
template <class T>
void attention_bwd_impl(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout, const Tensor& q,
                        const Tensor& k, const Tensor& v, const Tensor& out, const Tensor& lse,
                        const AttnShape& s, T scale, bool causal) {
  const int64_t dim = s.head_dim, ldq = s.num_q_heads * dim, ldkv = s.num_kv_heads * dim;
#pragma omp parallel for schedule(static)
  for (int64_t task = 0; task < s.batch * s.num_kv_heads; ++task) {
    const int64_t b = task / s.num_kv_heads, g = task % s.num_kv_heads;
    const T* k_bg = k.ptr<T>() + b * s.seq * ldkv + g * dim;
    T* dk_bg = dk.ptr<T>() + b * s.seq * ldkv + g * dim;
    T* dv_bg = dv.ptr<T>() + b * s.seq * ldkv + g * dim;
    for (int64_t j = 0; j < s.seq; ++j) {
      std::fill(dk_bg + j * ldkv, dk_bg + j * ldkv + dim, T(0));
      std::fill(dv_bg + j * ldkv, dv_bg + j * ldkv + dim, T(0));
    }
    std::vector<T> kt, vt, blk_t(static_cast<size_t>(kQueryBlock * s.seq));
    std::vector<T> p(blk_t.size()), ds(blk_t.size());
    pack_head_transposed(kt, k.ptr<T>(), s, b, g);
    pack_head_transposed(vt, v.ptr<T>(), s, b, g);
    for (int64_t h = g * s.group(); h < (g + 1) * s.group(); ++h) {
      const int64_t row0 = b * s.seq * ldq + h * dim;
      const T* q_bh = q.ptr<T>() + row0;
      const T* o_bh = out.ptr<T>() + row0;
      const T* do_bh = dout.ptr<T>() + row0;
      T* dq_bh = dq.ptr<T>() + row0;
      const T* lse_bh = lse.ptr<T>() + (b * s.num_q_heads + h) * s.seq;
      for (int64_t i0 = 0; i0 < s.seq; i0 += kQueryBlock) {
        const int64_t rows = std::min(kQueryBlock, s.seq - i0), n = causal ? i0 + rows : s.seq;
        gemm_nn(p.data(), n, q_bh + i0 * ldq, ldq, kt.data(), s.seq, rows, n, dim, scale, T(0));
        gemm_nn(ds.data(), n, do_bh + i0 * ldq, ldq, vt.data(), s.seq, rows, n, dim, T(1), T(0));
        for (int64_t r = 0; r < rows; ++r) {
          const int64_t i = i0 + r, visible = causal ? i + 1 : n;
          T delta = 0;
          for (int64_t d = 0; d < dim; ++d) delta += do_bh[i * ldq + d] * o_bh[i * ldq + d];
          T* pr = p.data() + r * n;
          T* dsr = ds.data() + r * n;  // holds dP on entry, dS on exit
          for (int64_t j = 0; j < visible; ++j) {
            pr[j] = std::exp(pr[j] - lse_bh[i]);
            dsr[j] = pr[j] * (dsr[j] - delta);
          }
          std::fill(pr + visible, pr + n, T(0));
          std::fill(dsr + visible, dsr + n, T(0));
        }
        gemm_nn(dq_bh + i0 * ldq, ldq, ds.data(), n, k_bg, ldkv, rows, dim, n, scale, T(0));
        transpose_block(blk_t, ds, rows, n);
        gemm_nn(dk_bg, ldkv, blk_t.data(), rows, q_bh + i0 * ldq, ldq, n, dim, rows, scale, T(1));
        transpose_block(blk_t, p, rows, n);
        gemm_nn(dv_bg, ldkv, blk_t.data(), rows, do_bh + i0 * ldq, ldq, n, dim, rows, T(1), T(1));
      }
    }
  }
}

}  // namespace

void CpuBackend::attention_fwd(Tensor out, Tensor lse, const Tensor& q, const Tensor& k,
                               const Tensor& v, int batch, float scale, bool causal) {
  const AttnShape s = shape_of(q, k, batch);
  dispatch_float(q.dtype, [&](auto tag) {
    using T = decltype(tag);
    attention_fwd_impl<T>(out, lse, q, k, v, s, T(scale), causal);
  });
}

void CpuBackend::attention_bwd(Tensor dq, Tensor dk, Tensor dv, const Tensor& dout,
                               const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                               const Tensor& lse, int batch, float scale, bool causal) {
  const AttnShape s = shape_of(q, k, batch);
  dispatch_float(q.dtype, [&](auto tag) {
    using T = decltype(tag);
    attention_bwd_impl<T>(dq, dk, dv, dout, q, k, v, out, lse, s, T(scale), causal);
  });
}

}  // namespace mop::cpu
