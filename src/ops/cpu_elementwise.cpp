// CPU reference: fill, copy (with dtype conversion), add, sum/sumsq, embedding and SwiGLU.
// Every output element is computed by one thread in a fixed order, so results do not depend on
// the number of OpenMP threads.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

#include "ops/cpu_ops.h"

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

void check_float_any(const Tensor& t, const char* name) {
  MOP_CHECK(t.device == Device::CPU, name, " is on ", device_name(t.device), ", expected cpu");
  MOP_CHECK(dtype_is_float(t.dtype), name, " has dtype ", dtype_name(t.dtype),
            ", expected f32, f64 or bf16");
  MOP_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data");
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
template <bool kSquare>
void reduce_to(Tensor out, const Tensor& x, const char* op) {
  check_float_any(x, kSquare ? "sumsq: x" : "sum: x");
  MOP_CHECK(out.device == Device::CPU, op, ": out must be on the cpu");
  MOP_CHECK(out.dtype == DType::F32 || out.dtype == DType::F64, op, ": out has dtype ",
            dtype_name(out.dtype), ", expected f32 or f64");
  MOP_CHECK(out.numel() == 1 && out.data, op, ": out must hold one element, has ", out.shape_str());
  double s = 0;
  const int64_t n = x.numel();
  for (int64_t i = 0; i < n; ++i) {
    double e = load_float(x, i);
    s += kSquare ? e * e : e;
  }
  if (out.dtype == DType::F32)
    out.ptr<float>()[0] = float(s);
  else
    out.ptr<double>()[0] = s;
}

}  // namespace

void fill(Tensor x, double value) {
  MOP_CHECK(x.device == Device::CPU, "fill: x is on ", device_name(x.device));
  MOP_CHECK(x.data != nullptr || x.numel() == 0, "fill: x has no data");
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

void copy(Tensor dst, const Tensor& src) {
  MOP_CHECK(dst.device == Device::CPU && src.device == Device::CPU, "copy: dst on ",
            device_name(dst.device), ", src on ", device_name(src.device), ", expected cpu");
  MOP_CHECK(dst.numel() == src.numel(), "copy: dst ", dst.shape_str(), " and src ", src.shape_str(),
            " differ in size");
  MOP_CHECK((dst.data && src.data) || dst.numel() == 0, "copy: missing data");
  const int64_t n = src.numel();
  if (dst.dtype == src.dtype) {
    if (n > 0 && dst.data != src.data) std::memmove(dst.data, src.data, src.bytes());
    return;
  }
  MOP_CHECK(dtype_is_float(dst.dtype) && dtype_is_float(src.dtype), "copy: no conversion from ",
            dtype_name(src.dtype), " to ", dtype_name(dst.dtype));
  // Converting in place would overwrite elements before they are read.
  MOP_CHECK(dst.data != src.data || n == 0, "copy: converting copy cannot run in place");
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

void add(Tensor out, const Tensor& a, const Tensor& b) {
  DType dt = compute_dtype(a, "add: a");
  MOP_CHECK(same_shape(a, b) && same_shape(a, out), "add: shapes ", out.shape_str(), " = ",
            a.shape_str(), " + ", b.shape_str());
  for (const Tensor* t : std::initializer_list<const Tensor*>{&out, &a, &b})
    MOP_CHECK(t->dtype == dt && t->device == Device::CPU && (t->data || t->numel() == 0),
              "add: out, a and b must be cpu ", dtype_name(dt), " tensors");
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    const T* pa = a.ptr<T>();
    const T* pb = b.ptr<T>();
    T* po = out.ptr<T>();
    const int64_t n = out.numel();
#pragma omp parallel for schedule(static)
    for (int64_t i = 0; i < n; ++i) po[i] = pa[i] + pb[i];
  });
}

void sumsq(Tensor out, const Tensor& x) {
  reduce_to<true>(out, x, "sumsq");
}
void sum(Tensor out, const Tensor& x) {
  reduce_to<false>(out, x, "sum");
}

void embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) {
  DType dt = compute_dtype(table, "embedding_fwd: table");
  MOP_CHECK(table.ndim == 2, "embedding_fwd: table must be [V,H], is ", table.shape_str());
  const int64_t vocab = table.shape[0], hidden = table.shape[1];
  MOP_CHECK(ids.ndim == 1, "embedding_fwd: ids must be [T], is ", ids.shape_str());
  const int64_t num_tokens = ids.shape[0];
  expect(ids, "embedding_fwd: ids", DType::I32, {num_tokens});
  expect(table, "embedding_fwd: table", dt, {vocab, hidden});
  expect(out, "embedding_fwd: out", dt, {num_tokens, hidden});
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    MOP_CHECK(id[t] >= 0 && id[t] < vocab, "embedding_fwd: ids[", t, "] = ", id[t], " outside [0, ",
              vocab, ")");
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t t = 0; t < num_tokens; ++t)
      std::memcpy(out.ptr<T>() + t * hidden, table.ptr<T>() + id[t] * hidden,
                  size_t(hidden) * sizeof(T));
  });
}

void embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) {
  DType dt = compute_dtype(dtable, "embedding_bwd: dtable");
  MOP_CHECK(dtable.ndim == 2, "embedding_bwd: dtable must be [V,H], is ", dtable.shape_str());
  const int64_t vocab = dtable.shape[0], hidden = dtable.shape[1];
  MOP_CHECK(ids.ndim == 1, "embedding_bwd: ids must be [T], is ", ids.shape_str());
  const int64_t num_tokens = ids.shape[0];
  expect(ids, "embedding_bwd: ids", DType::I32, {num_tokens});
  expect(dtable, "embedding_bwd: dtable", dt, {vocab, hidden});
  expect(dout, "embedding_bwd: dout", dt, {num_tokens, hidden});
  const int32_t* id = ids.ptr<int32_t>();
  for (int64_t t = 0; t < num_tokens; ++t)
    MOP_CHECK(id[t] >= 0 && id[t] < vocab, "embedding_bwd: ids[", t, "] = ", id[t], " outside [0, ",
              vocab, ")");
  // Tokens add into the table in token order; repeated ids make a parallel loop over tokens racy,
  // and T·H additions are cheap next to the rest of the step.
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
    for (int64_t t = 0; t < num_tokens; ++t) {
      T* dst = dtable.ptr<T>() + id[t] * hidden;
      const T* src = dout.ptr<T>() + t * hidden;
      for (int64_t c = 0; c < hidden; ++c) dst[c] += src[c];
    }
  });
}

void swiglu_fwd(Tensor h, const Tensor& gu) {
  DType dt = compute_dtype(gu, "swiglu_fwd: gu");
  MOP_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0, "swiglu_fwd: gu must be [M,2F], is ",
            gu.shape_str());
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  expect(h, "swiglu_fwd: h", dt, {rows, width});
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gu.ptr<T>() + r * 2 * width;
      const T* u = g + width;
      T* out = h.ptr<T>() + r * width;
      for (int64_t c = 0; c < width; ++c) {
        T sig = T(1) / (T(1) + std::exp(-g[c]));
        out[c] = g[c] * sig * u[c];
      }
    }
  });
}

void swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) {
  DType dt = compute_dtype(gu, "swiglu_bwd: gu");
  MOP_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0, "swiglu_bwd: gu must be [M,2F], is ",
            gu.shape_str());
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  expect(dh, "swiglu_bwd: dh", dt, {rows, width});
  expect(dgu, "swiglu_bwd: dgu", dt, {rows, 2 * width});
  // d silu(g)/dg = σ(g)·(1 + g·(1 − σ(g))). g and u are read before dg and du are written, so
  // dgu may alias gu.
  dispatch_float(dt, [&](auto tag) {
    using T = decltype(tag);
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < rows; ++r) {
      const T* g = gu.ptr<T>() + r * 2 * width;
      const T* u = g + width;
      const T* d = dh.ptr<T>() + r * width;
      T* dg = dgu.ptr<T>() + r * 2 * width;
      T* du = dg + width;
      for (int64_t c = 0; c < width; ++c) {
        T gc = g[c], uc = u[c];
        T sig = T(1) / (T(1) + std::exp(-gc));
        dg[c] = d[c] * uc * sig * (T(1) + gc * (T(1) - sig));
        du[c] = d[c] * gc * sig;
      }
    }
  });
}

}  // namespace mop::cpu
