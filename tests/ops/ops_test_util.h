// Helpers for the op tests: the CPU backend, full-precision random fills, weighted-sum objectives,
// a central-difference gradient check, bitwise comparison and a thread-count switch.
// Gradient checks run in fp64: L = Σ W ⊙ outputs with fixed random W, perturbed one input element
// at a time, compared with the analytic backward fed dOut = W.
#pragma once

#include <omp.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <string>

#include "catch.h"
#include "ops/ops.h"
#include "test_util.h"

namespace mop::test {

// Central differences with h = 1e-5 in fp64 have O(h²) ≈ 1e-10 truncation and ≈ 1e-16·|L|/h
// ≈ 1e-10 rounding error for the O(1)-sized objectives used here; 1e-6 relative (plus 1e-7
// absolute for gradients near zero) leaves three orders of margin and still catches any wrong
// term, which is O(1).
constexpr double kFdStep = 1e-5;
constexpr double kFdRelTol = 1e-6;
constexpr double kFdAbsTol = 1e-7;

// fp32 and fp64 runs of one op on bf16-exact inputs differ only by fp32 rounding of sums of
// O(10–100) O(1) terms: a few ulps of 1.2e-7 times the term count, well below 1e-4.
constexpr double kF32VsF64Tol = 1e-4;

inline Ops& cpu_ops() {
  static std::unique_ptr<Ops> ops = make_cpu_ops();
  return *ops;
}

// Uniform values in [lo, hi) at full fp64 precision (no bf16 rounding): gradient checks want no
// accidental ties (top-k) or exactly representable cancellations.
inline void fill_random(HostTensor& x, uint64_t seed, double lo = -1, double hi = 1) {
  for (int64_t i = 0; i < x.numel(); ++i) {
    double u = double(philox_u64(seed, 11, uint64_t(i)) >> 11) / 9007199254740992.0;
    x.set(i, lo + (hi - lo) * u);
  }
}

inline HostTensor random_tensor(DType dtype, std::initializer_list<int64_t> dims, uint64_t seed,
                                double lo = -1, double hi = 1) {
  HostTensor t(dtype, dims);
  fill_random(t, seed, lo, hi);
  return t;
}

// Same values rounded through bf16 (exact in f32 and f64: for fp32-vs-fp64 comparisons).
inline HostTensor bf16_exact_tensor(DType dtype, std::initializer_list<int64_t> dims, uint64_t seed,
                                    double lo = -1, double hi = 1) {
  HostTensor t(dtype, dims);
  fill_uniform(t, seed, lo, hi);
  return t;
}

// The same values in another float dtype.
inline HostTensor converted(const HostTensor& x, DType dtype) {
  HostTensor y = x;
  y.t.dtype = dtype;
  y.storage.assign((y.t.bytes() + 7) / 8 + 1, 0);
  y.t.data = y.storage.data();
  for (int64_t i = 0; i < x.numel(); ++i) y.set(i, x.get(i));
  return y;
}

inline double weighted_sum(const HostTensor& w, const HostTensor& out) {
  double s = 0;
  for (int64_t i = 0; i < out.numel(); ++i) s += w.get(i) * out.get(i);
  return s;
}

inline double max_abs(const HostTensor& x) {
  double m = 0;
  for (int64_t i = 0; i < x.numel(); ++i) m = std::max(m, std::fabs(x.get(i)));
  return m;
}

// Integers in [lo, hi], as f32: exact in bf16 and, summed in fp32, exact in GEMMs of moderate size
// (CUTLASS's trick), so GPU results compare exactly.
inline HostTensor int_tensor(std::initializer_list<int64_t> dims, uint64_t seed, int lo = -3,
                             int hi = 3) {
  HostTensor t(DType::F32, dims);
  for (int64_t i = 0; i < t.numel(); ++i)
    t.set(i, double(lo + int(philox_u64(seed, 5, uint64_t(i)) % uint64_t(hi - lo + 1))));
  // A draw of all zeros (likely for tiny tensors) would make the comparison vacuous.
  if (t.numel() > 0 && max_abs(t) == 0) t.set(0, 1.0);
  REQUIRE((t.numel() == 0 || max_abs(t) > 0));
  return t;
}

inline bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.t.dtype == b.t.dtype && a.numel() == b.numel() &&
         std::memcmp(a.t.data, b.t.data, a.t.bytes()) == 0;
}

// Checks the analytic gradient `grad` of input `x` against central differences of `loss`, for
// every element of x. The gradient must not vanish (a zero backward would pass trivially).
inline void check_grad(const std::string& what, HostTensor& x, const HostTensor& grad,
                       const std::function<double()>& loss) {
  REQUIRE(x.numel() == grad.numel());
  CHECK(max_abs(grad) > 0);
  int64_t num_bad = 0, first_bad = -1;
  double worst = 0;
  for (int64_t i = 0; i < x.numel(); ++i) {
    const double saved = x.get(i);
    x.set(i, saved + kFdStep);
    const double up = loss();
    x.set(i, saved - kFdStep);
    const double down = loss();
    x.set(i, saved);
    const double numeric = (up - down) / (2 * kFdStep), analytic = grad.get(i);
    const double err = std::fabs(numeric - analytic);
    if (err > kFdAbsTol + kFdRelTol * std::fabs(analytic)) {
      if (num_bad++ == 0) first_bad = i;
      worst = std::max(worst, err);
    }
  }
  INFO(what << ": " << num_bad << " of " << x.numel() << " elements off; first at " << first_bad
            << ", worst abs error " << worst);
  CHECK(num_bad == 0);
}

// Runs f with the given number of OpenMP threads, restoring the previous setting.
template <class F>
void with_threads(int num_threads, F&& f) {
  const int saved = omp_get_max_threads();
  omp_set_num_threads(num_threads);
  f();
  omp_set_num_threads(saved);
}

}  // namespace mop::test
