// CPU reference: the route plan (counting sort of token→expert assignments, stable in (t, k)) and
// the permutation of token rows into expert-contiguous order and back, with their backwards.
// Sums over a token's K assignments run in k order; rows are spread over threads, one writer each.
#include <algorithm>
#include <vector>

#include "ops/cpu_ops.h"

namespace mop::cpu {
namespace {

// Every entry of an I32 index tensor lies in [0, limit).
void check_range(const Tensor& idx, int64_t limit, const char* op, const char* name) {
  const int32_t* p = idx.ptr<int32_t>();
  for (int64_t i = 0; i < idx.numel(); ++i)
    MOP_CHECK(p[i] >= 0 && p[i] < limit, op, ": ", name, "[", i, "] = ", p[i], " outside [0, ",
              limit, ")");
}

// slot_of must be a permutation of [0, rows) where rows are written through it (else two tokens
// would write one row, from two threads).
void check_permutation(const Tensor& slot_of, const char* op) {
  const int64_t n = slot_of.numel();
  check_range(slot_of, n, op, "slot_of");
  std::vector<bool> seen(size_t(n), false);
  const int32_t* p = slot_of.ptr<int32_t>();
  for (int64_t i = 0; i < n; ++i) {
    MOP_CHECK(!seen[size_t(p[i])], op, ": slot_of is not a permutation (row ", p[i], " twice)");
    seen[size_t(p[i])] = true;
  }
}

// [T,H] token rows and [T·K,H] expert-ordered rows of one compute dtype; returns T.
int64_t check_rows(const Tensor& tok, const Tensor& perm, int64_t top_k, const char* op) {
  DType dt = compute_dtype(tok, op);
  MOP_CHECK(tok.ndim == 2, op, ": token rows must be [T,H], are ", tok.shape_str());
  const int64_t num_tokens = tok.shape[0], hidden = tok.shape[1];
  expect(tok, "moe permutation: token rows [T,H]", dt, {num_tokens, hidden});
  expect(perm, "moe permutation: expert-ordered rows [T·K,H]", dt, {num_tokens * top_k, hidden});
  return num_tokens;
}

}  // namespace

void moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                    const Tensor& topk_idx) {
  MOP_CHECK(topk_idx.ndim == 2 && counts.ndim == 1, "moe_route_plan: topk_idx ",
            topk_idx.shape_str(), " must be [T,K], counts ", counts.shape_str(), " [E]");
  const int64_t num_tokens = topk_idx.shape[0], top_k = topk_idx.shape[1];
  const int64_t num_experts = counts.shape[0], n = num_tokens * top_k;
  expect(topk_idx, "moe_route_plan: topk_idx", DType::I32, {num_tokens, top_k});
  expect(counts, "moe_route_plan: counts", DType::I32, {num_experts});
  expect(offsets, "moe_route_plan: offsets", DType::I32, {num_experts + 1});
  expect(perm_src, "moe_route_plan: perm_src", DType::I32, {n});
  expect(slot_of, "moe_route_plan: slot_of", DType::I32, {n});
  check_range(topk_idx, num_experts, "moe_route_plan", "topk_idx");
  const int32_t* idx = topk_idx.ptr<int32_t>();
  int32_t* cnt = counts.ptr<int32_t>();
  int32_t* off = offsets.ptr<int32_t>();
  std::fill_n(cnt, num_experts, 0);
  for (int64_t a = 0; a < n; ++a) ++cnt[idx[a]];
  off[0] = 0;
  for (int64_t e = 0; e < num_experts; ++e) off[e + 1] = off[e] + cnt[e];
  // Assignments a = t·K + k in increasing order: rows of an expert are sorted by (t, k).
  std::vector<int32_t> next(off, off + num_experts);
  for (int64_t a = 0; a < n; ++a) {
    const int32_t row = next[size_t(idx[a])]++;
    perm_src.ptr<int32_t>()[row] = int32_t(a / top_k);
    slot_of.ptr<int32_t>()[a] = row;
  }
}

void moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) {
  DType dt = compute_dtype(x, "moe_permute_fwd: x");
  MOP_CHECK(x.ndim == 2 && xp.ndim == 2 && perm_src.ndim == 1, "moe_permute_fwd: xp ",
            xp.shape_str(), ", x ", x.shape_str(), ", perm_src ", perm_src.shape_str());
  const int64_t rows = perm_src.shape[0], hidden = x.shape[1];
  expect(xp, "moe_permute_fwd: xp", dt, {rows, hidden});
  expect(perm_src, "moe_permute_fwd: perm_src", DType::I32, {rows});
  check_range(perm_src, x.shape[0], "moe_permute_fwd", "perm_src");
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const int32_t* src = perm_src.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* from = x.ptr<T>() + int64_t(src[r]) * hidden;
      std::copy(from, from + hidden, xp.ptr<T>() + r * hidden);
    }
  });
}

void moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                     bool accumulate) {
  MOP_CHECK(top_k >= 1, "moe_permute_bwd: top_k = ", top_k);
  const int64_t num_tokens = check_rows(dx, dxp, top_k, "moe_permute_bwd");
  const int64_t hidden = dx.shape[1];
  expect(slot_of, "moe_permute_bwd: slot_of", DType::I32, {num_tokens * top_k});
  check_range(slot_of, num_tokens * top_k, "moe_permute_bwd", "slot_of");
  dispatch_float(dx.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int32_t* slot = slot_of.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      T* out = dx.ptr<T>() + t * hidden;
      if (!accumulate) std::fill(out, out + hidden, T(0));
      for (int64_t k = 0; k < top_k; ++k) {
        const T* src = dxp.ptr<T>() + int64_t(slot[t * top_k + k]) * hidden;
        for (int64_t c = 0; c < hidden; ++c) out[c] += src[c];
      }
    }
  });
}

void moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of, const Tensor& topk_w,
                       bool accumulate) {
  MOP_CHECK(topk_w.ndim == 2, "moe_unpermute_fwd: topk_w must be [T,K], is ", topk_w.shape_str());
  const int64_t top_k = topk_w.shape[1];
  const int64_t num_tokens = check_rows(y, yp, top_k, "moe_unpermute_fwd");
  const int64_t hidden = y.shape[1];
  expect(topk_w, "moe_unpermute_fwd: topk_w", acc_dtype(y.dtype), {num_tokens, top_k});
  expect(slot_of, "moe_unpermute_fwd: slot_of", DType::I32, {num_tokens * top_k});
  check_range(slot_of, num_tokens * top_k, "moe_unpermute_fwd", "slot_of");
  dispatch_float(y.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int32_t* slot = slot_of.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      T* out = y.ptr<T>() + t * hidden;
      if (!accumulate) std::fill(out, out + hidden, T(0));
      for (int64_t k = 0; k < top_k; ++k) {
        const T wk = topk_w.ptr<T>()[t * top_k + k];
        const T* src = yp.ptr<T>() + int64_t(slot[t * top_k + k]) * hidden;
        for (int64_t c = 0; c < hidden; ++c) out[c] += wk * src[c];
      }
    }
  });
}

void moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                       const Tensor& slot_of, const Tensor& topk_w) {
  MOP_CHECK(topk_w.ndim == 2, "moe_unpermute_bwd: topk_w must be [T,K], is ", topk_w.shape_str());
  const int64_t top_k = topk_w.shape[1];
  const int64_t num_tokens = check_rows(dy, yp, top_k, "moe_unpermute_bwd");
  const int64_t hidden = dy.shape[1];
  expect(dyp, "moe_unpermute_bwd: dyp", dy.dtype, {num_tokens * top_k, hidden});
  expect(topk_w, "moe_unpermute_bwd: topk_w", acc_dtype(dy.dtype), {num_tokens, top_k});
  expect(dtopk_w, "moe_unpermute_bwd: dtopk_w", acc_dtype(dy.dtype), {num_tokens, top_k});
  expect(slot_of, "moe_unpermute_bwd: slot_of", DType::I32, {num_tokens * top_k});
  check_permutation(slot_of, "moe_unpermute_bwd");
  dispatch_float(dy.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int32_t* slot = slot_of.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t) {
      const T* d = dy.ptr<T>() + t * hidden;
      for (int64_t k = 0; k < top_k; ++k) {
        const int64_t row = slot[t * top_k + k];
        const T wk = topk_w.ptr<T>()[t * top_k + k];
        const T* ypr = yp.ptr<T>() + row * hidden;
        T* out = dyp.ptr<T>() + row * hidden;
        T dot = 0;
        for (int64_t c = 0; c < hidden; ++c) {
          dot += d[c] * ypr[c];
          out[c] = wk * d[c];
        }
        dtopk_w.ptr<T>()[t * top_k + k] = dot;
      }
    }
  });
}

}  // namespace mop::cpu
