// CPU reference: fill, copy (with dtype conversion), add, sum/sumsq.
// Every output element is computed by one thread in a fixed order, so results do not depend on
// the number of OpenMP threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "core/exact_sum.h"
#include "ops/cpu/cpu.h"

namespace mop::cpu {
namespace {

// double → bf16 with one correct nearest-even rounding. A plain double → float → bf16 chain rounds
// twice: a double just above a bf16 tie can round to exactly the tie in float, which ties-to-even
// then resolves downwards. Rounding to float "to odd" (truncate, then set the last bit when
// inexact) keeps that information in a sticky bit; float has 16 more fraction bits than bf16, so
// the second rounding (float_to_bf16) then equals the direct one.
bf16 double_to_bf16(double d) {
  float f = float(d);
  if (!std::isnan(d) && double(f) != d) {
    if (std::fabs(double(f)) > std::fabs(d)) f = std::nextafter(f, 0.0f);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    u |= 1u;
    std::memcpy(&f, &u, 4);
  }
  return float_to_bf16(f);
}

// Element i of a float tensor (F32, F64 or BF16) as double.
double load_float(const Tensor& t, int64_t i) {
  switch (t.dtype) {
    case DType::F32:
      return t.ptr<float>()[i];
    case DType::F64:
      return t.ptr<double>()[i];
    case DType::BF16:
      return bf16_to_float(t.ptr<bf16>()[i]);
    default:
      MOP_UNREACHABLE("not a float dtype: ", dtype_name(t.dtype));
  }
}

template <class Src>
void convert_from(Tensor dst, const Src* s, int64_t n) {
  switch (dst.dtype) {
    case DType::F32: {
      float* d = dst.ptr<float>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = float(s[i]);
      return;
    }
    case DType::F64: {
      double* d = dst.ptr<double>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = double(s[i]);
      return;
    }
    case DType::BF16: {
      bf16* d = dst.ptr<bf16>();
#pragma omp parallel for schedule(static)
      for (int64_t i = 0; i < n; ++i) d[i] = double_to_bf16(double(s[i]));
      return;
    }
    default:
      MOP_UNREACHABLE();
  }
}

// Scalar accumulation in double over any float dtype, in index order (deterministic).
void sum_to(Tensor out, const Tensor& x) {
  double s = 0;
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) s += load_float(x, i);
  if (out.dtype == DType::F32)
    out.ptr<float>()[0] = float(s);
  else
    out.ptr<double>()[0] = s;
}

}  // namespace

void CpuBackend::fill(Tensor x, double value) {
  const int64_t n = x.numel();
  switch (x.dtype) {
    case DType::F32:
      std::fill_n(x.ptr<float>(), n, float(value));
      return;
    case DType::F64:
      std::fill_n(x.ptr<double>(), n, value);
      return;
    case DType::BF16:
      std::fill_n(x.ptr<bf16>(), n, double_to_bf16(value));
      return;
    case DType::I32:
      MOP_CHECK(value == std::trunc(value) && std::fabs(value) <= 2147483647.0, "fill: ", value,
                " is not an i32 value");
      std::fill_n(x.ptr<int32_t>(), n, int32_t(value));
      return;
    default:
      MOP_CHECK(false, "fill: unsupported dtype ", dtype_name(x.dtype));
  }
}

void CpuBackend::copy(Tensor dst, const Tensor& src) {
  const int64_t n = src.numel();
  if (dst.dtype == src.dtype) {
    if (n > 0 && dst.data != src.data) std::memmove(dst.data, src.data, src.bytes());
    return;
  }
  switch (src.dtype) {
    case DType::F32:
      convert_from(dst, src.ptr<float>(), n);
      return;
    case DType::F64:
      convert_from(dst, src.ptr<double>(), n);
      return;
    case DType::BF16: {
      // bf16 → float is exact; go through float so convert_from sees a plain arithmetic type.
      std::vector<float> tmp(static_cast<size_t>(n));
      for (int64_t i = 0; i < n; ++i) tmp[size_t(i)] = bf16_to_float(src.ptr<bf16>()[i]);
      convert_from(dst, tmp.data(), n);
      return;
    }
    default:
      MOP_UNREACHABLE();
  }
}

void CpuBackend::add(Tensor out, const Tensor& a, const Tensor& b) {
  dispatch_float(a.dtype, [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.ptr<T>();
    const T* pb = b.ptr<T>();
    T* po = out.ptr<T>();
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  });
}

// The blocks of op_list.inc's sumsq, each summed in its fixed tree and added exactly: the threads
// may take the blocks in any split.
void CpuBackend::sumsq(Tensor out, const Tensor& x) {
  const int64_t n = x.numel(), blocks = (n + kSumsqBlock - 1) / kSumsqBlock;
  ExactSum total;
#pragma omp parallel
  {
    ExactSum mine;
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      double g[kSumsqBlock / 4];
      for (int j = 0; j < kSumsqBlock / 4; ++j) {
        double sq[4];
        for (int k = 0; k < 4; ++k) {
          const int64_t i = b * kSumsqBlock + 4 * j + k;
          const double e = i < n ? load_float(x, i) : 0.0;
          sq[k] = e * e;
        }
        g[j] = (sq[0] + sq[1]) + (sq[2] + sq[3]);
      }
      for (int off = kSumsqBlock / 8; off >= 1; off /= 2)
        for (int j = 0; j < off; ++j) g[j] += g[j + off];
      mine.add_double(g[0]);
    }
#pragma omp critical
    total.add(mine);
  }
  int64_t* o = out.ptr<int64_t>();
  for (int i = 0; i < 3; ++i) std::memcpy(&o[i], &total.words[i], 8);
  o[3] = int64_t(total.bad);
}
void CpuBackend::sum(Tensor out, const Tensor& x) {
  sum_to(out, x);
}

}  // namespace mop::cpu
