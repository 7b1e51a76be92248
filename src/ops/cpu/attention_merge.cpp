// CPU reference: merging a partial attention result (out, lse of one block of keys) into an
// accumulator (ring attention, see ops.h). Softmax over the union of two disjoint key sets:
// with lse' = logaddexp(lse_acc, lse) the two partial outputs are weighted by exp(lse_x − lse').
#include <cmath>
#include <limits>

#include "ops/cpu/cpu.h"

namespace mop::cpu {

void CpuBackend::attention_merge(Tensor out_acc, Tensor lse_acc, const Tensor& o,
                                 const Tensor& lse, int batch) {
  const int64_t rows = o.shape[0], heads = o.shape[1], dim = o.shape[2], seq = rows / batch;
  dispatch_float(o.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* po = o.ptr<T>();
    const T* pl = lse.ptr<T>();
    T* pa = out_acc.ptr<T>();
    T* pla = lse_acc.ptr<T>();
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < rows; ++t) {
      const int64_t b = t / seq, s = t % seq;
      for (int64_t h = 0; h < heads; ++h) {
        T& la = pla[(b * heads + h) * seq + s];
        const T lb = pl[(b * heads + h) * seq + s];
        T* acc = pa + (t * heads + h) * dim;
        const T* part = po + (t * heads + h) * dim;
        // −inf on either side: that side has seen no keys and gets weight 0 (its values are not
        // read, so an unset accumulator does not matter). Both −inf: nothing to merge.
        const T m = std::max(la, lb);
        if (m == -std::numeric_limits<T>::infinity()) continue;
        const T l = m + std::log(std::exp(la - m) + std::exp(lb - m));
        const T wa = std::exp(la - l), wb = std::exp(lb - l);
        for (int64_t d = 0; d < dim; ++d) acc[d] = (wa == 0 ? T(0) : wa * acc[d]) + wb * part[d];
        la = l;
      }
    }
  });
}

}  // namespace mop::cpu
