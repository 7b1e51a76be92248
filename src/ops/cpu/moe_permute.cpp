// CPU reference: the route plan (counting sort of token→expert assignments, stable in (t, k)) and
// the permutation of token rows into expert-contiguous order and back, with their backwards.
// Sums over a token's K assignments run in k order; rows are spread over threads, one writer each.
#include <algorithm>
#include <vector>

#include "ops/cpu/cpu.h"

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

}  // namespace

void CpuBackend::moe_route_plan(Tensor counts, Tensor offsets, Tensor perm_src, Tensor slot_of,
                                const Tensor& topk_idx) {
  const int64_t num_tokens = topk_idx.shape[0], top_k = topk_idx.shape[1];
  const int64_t num_experts = counts.shape[0], n = num_tokens * top_k;
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

void CpuBackend::moe_permute_fwd(Tensor xp, const Tensor& x, const Tensor& perm_src) {
  const int64_t rows = perm_src.shape[0], hidden = x.shape[1];
  check_range(perm_src, x.shape[0], "moe_permute_fwd", "perm_src");
  dispatch_float(x.dtype, [&](auto tag) {
    using T = decltype(tag);
    const int32_t* src = perm_src.ptr<int32_t>();
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* from = x.ptr<T>() + int64_t(src[r]) * hidden;
      std::copy(from, from + hidden, xp.ptr<T>() + r * hidden);
    }
  });
}

void CpuBackend::moe_permute_bwd(Tensor dx, const Tensor& dxp, const Tensor& slot_of, int top_k,
                                 bool accumulate) {
  const int64_t num_tokens = dx.shape[0], hidden = dx.shape[1];
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

void CpuBackend::moe_unpermute_fwd(Tensor y, const Tensor& yp, const Tensor& slot_of,
                                   const Tensor& topk_w, bool accumulate) {
  const int64_t top_k = topk_w.shape[1], num_tokens = y.shape[0], hidden = y.shape[1];
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

void CpuBackend::moe_unpermute_bwd(Tensor dyp, Tensor dtopk_w, const Tensor& dy, const Tensor& yp,
                                   const Tensor& slot_of, const Tensor& topk_w) {
  const int64_t top_k = topk_w.shape[1], num_tokens = dy.shape[0], hidden = dy.shape[1];
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
