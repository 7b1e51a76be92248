// Host AdamW kernels (scalar, AVX2, AVX-512), run-time ISA dispatch and the pool submission.
// Bitwise identity with ops/cpu/adamw.cpp rests on: the same float operations in the same order,
// each rounded once (IEEE add/sub/mul/div/sqrt are correctly rounded, so a lane of vdivps or
// vsqrtps equals divss or sqrtss); no fused multiply-add; the same MXCSR (the pool runs chunks
// under the submitter's floating-point environment); bf16 conversions done with the same integer
// operations as core/dtype.h.

// GCC's intrinsics are written as generic vector arithmetic (`a * b`), and GCC contracts a·b + c
// into one FMA whenever the target has it — target("avx512f") implies FMA (checked with g++ 12,
// even under -std=c++20) — which rounds once instead of twice and changes bits. This file-scope
// pragma, placed before the includes as in ops/cpu/adamw.cpp, keeps every multiply and add separate
// (checked with objdump: no vfmadd in this object).
#pragma GCC optimize("fp-contract=off")

#include "optim/host_adamw.h"

#include <algorithm>
#include <cmath>

#if defined(__x86_64__)
// GCC 12's AVX-512 headers pass a self-initialised "undefined" vector to masked builtins, which
// -Wmaybe-uninitialized reports wherever they are inlined (GCC bug 105593, a false positive).
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#define MOP_HAVE_X86_SIMD 1
#endif

namespace mop {
namespace {

// The per-call constants, computed in float exactly as the reference computes them.
struct AdamWConsts {
  float beta1, beta2, one_minus_beta1, one_minus_beta2;
  float step_size, sqrt_bc2, eps, decay, grad_scale;
};

AdamWConsts adamw_consts(const AdamWArgs& a) {
  AdamWConsts c;
  c.beta1 = a.beta1;
  c.beta2 = a.beta2;
  c.one_minus_beta1 = 1.0f - a.beta1;
  c.one_minus_beta2 = 1.0f - a.beta2;
  c.step_size = a.lr / a.bias_correction1;
  c.sqrt_bc2 = std::sqrt(a.bias_correction2);
  c.eps = a.eps;
  c.decay = 1.0f - a.lr * a.weight_decay;
  c.grad_scale = a.grad_scale;
  return c;
}

inline float grad_to_float(float g) {
  return g;
}
inline float grad_to_float(bf16 g) {
  return bf16_to_float(g);
}

inline bf16 to_weight(float x, const bf16*) {
  return float_to_bf16(x);
}
inline float to_weight(float x, const float*) {
  return x;
}

// Elements [begin, end): the reference loop body, operation for operation. W: the weights'
// type (bf16 or float). Without `state` master, m and v are only read.
template <class G, class W>
void update_scalar(float* p, float* m, float* v, const G* grad, W* w, bool state, int64_t begin,
                   int64_t end, const AdamWConsts& c) {
  for (int64_t i = begin; i < end; ++i) {
    const float g = grad_to_float(grad[i]) * c.grad_scale;
    const float mi = c.beta1 * m[i] + c.one_minus_beta1 * g;
    const float vi = c.beta2 * v[i] + c.one_minus_beta2 * (g * g);
    const float denom = std::sqrt(vi) / c.sqrt_bc2 + c.eps;
    const float pi = p[i] * c.decay - (c.step_size * mi) / denom;
    if (state) {
      p[i] = pi;
      m[i] = mi;
      v[i] = vi;
    }
    if (w) w[i] = to_weight(pi, w);
  }
}

#ifdef MOP_HAVE_X86_SIMD
// Functions are compiled for their ISA with target attributes rather than -m flags, so the binary
// still runs on CPUs without it; they are called only after simd_isa_supported(). Only avx512f
// instructions are used (vpmovzxwd, vpmovdw, unsigned compares are all AVX-512F).
#define MOP_AVX512 __attribute__((target("avx512f")))
#define MOP_AVX2 __attribute__((target("avx2")))

// The bf16 weights are only written (the GPU copy reads them later), so the vector loops store
// them with non-temporal stores: a normal store first reads each line into the cache, 30 bytes of
// traffic per parameter instead of 28. Measured on a 2-core Zen 4 VM: +7% params/s while the host
// was loaded, within noise (±3%) when quiet; to be confirmed on the H200 host. They need aligned
// addresses, so the elements before alignment go through the scalar code; the sfence makes the
// streamed lines globally visible before the pool reports the chunk done.
inline int64_t elements_to_alignment(const bf16* w, uintptr_t align) {
  return w ? int64_t((align - reinterpret_cast<uintptr_t>(w) % align) % align / sizeof(bf16)) : 0;
}
// fp32 weights (CPU runs) are stored plainly: no alignment needed.
inline int64_t elements_to_alignment(const float*, uintptr_t) {
  return 0;
}

// ---- AVX-512: 16 floats -------------------------------------------------------------------------
MOP_AVX512 inline __m512 load16(const float* g) {
  return _mm512_loadu_ps(g);
}
// bf16 → fp32 is the bf16 bits in the top half of the float (exact, NaN payloads included).
MOP_AVX512 inline __m512 load16(const bf16* g) {
  const __m256i h = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(g));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
}
// float_to_bf16 on 16 lanes: NaN → top half with the quiet bit (0x40 in bf16) set; otherwise
// u + 0x7fff + lsb(u >> 16), top half (round to nearest, ties to even; ±inf and the largest
// finite values round as the scalar code does, 32-bit integer adds wrap identically).
MOP_AVX512 inline __m256i to_bf16_16(__m512 x) {
  const __m512i u = _mm512_castps_si512(x);
  const __m512i hi = _mm512_srli_epi32(u, 16);
  const __m512i lsb = _mm512_and_si512(hi, _mm512_set1_epi32(1));
  const __m512i rounded =
      _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7fff)), lsb), 16);
  const __m512i quiet_nan = _mm512_or_si512(hi, _mm512_set1_epi32(0x40));
  const __mmask16 is_nan = _mm512_cmpgt_epu32_mask(
      _mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)), _mm512_set1_epi32(0x7f800000));
  return _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, quiet_nan));
}

MOP_AVX512 inline void store_weights16(bf16* w, __m512 x) {
  _mm256_stream_si256(reinterpret_cast<__m256i*>(w), to_bf16_16(x));
}
MOP_AVX512 inline void store_weights16(float* w, __m512 x) {
  _mm512_storeu_ps(w, x);
}

template <class G, class W>
MOP_AVX512 void update_avx512(float* p, float* m, float* v, const G* grad, W* w, bool state,
                              int64_t n, const AdamWConsts& c) {
  const __m512 beta1 = _mm512_set1_ps(c.beta1), beta2 = _mm512_set1_ps(c.beta2);
  const __m512 one_minus_beta1 = _mm512_set1_ps(c.one_minus_beta1);
  const __m512 one_minus_beta2 = _mm512_set1_ps(c.one_minus_beta2);
  const __m512 step_size = _mm512_set1_ps(c.step_size), sqrt_bc2 = _mm512_set1_ps(c.sqrt_bc2);
  const __m512 eps = _mm512_set1_ps(c.eps), decay = _mm512_set1_ps(c.decay);
  const __m512 grad_scale = _mm512_set1_ps(c.grad_scale);
  int64_t i = std::min(n, elements_to_alignment(w, 32));
  update_scalar(p, m, v, grad, w, state, 0, i, c);
  for (; i + 16 <= n; i += 16) {
    const __m512 g = _mm512_mul_ps(load16(grad + i), grad_scale);
    const __m512 mi = _mm512_add_ps(_mm512_mul_ps(beta1, _mm512_loadu_ps(m + i)),
                                    _mm512_mul_ps(one_minus_beta1, g));
    const __m512 vi = _mm512_add_ps(_mm512_mul_ps(beta2, _mm512_loadu_ps(v + i)),
                                    _mm512_mul_ps(one_minus_beta2, _mm512_mul_ps(g, g)));
    const __m512 denom = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), sqrt_bc2), eps);
    const __m512 pi = _mm512_sub_ps(_mm512_mul_ps(_mm512_loadu_ps(p + i), decay),
                                    _mm512_div_ps(_mm512_mul_ps(step_size, mi), denom));
    if (state) {
      _mm512_storeu_ps(p + i, pi);
      _mm512_storeu_ps(m + i, mi);
      _mm512_storeu_ps(v + i, vi);
    }
    if (w) store_weights16(w + i, pi);
  }
  _mm_sfence();
  update_scalar(p, m, v, grad, w, state, i, n, c);
}

// ---- AVX2: 8 floats -----------------------------------------------------------------------------
MOP_AVX2 inline __m256 load8(const float* g) {
  return _mm256_loadu_ps(g);
}
MOP_AVX2 inline __m256 load8(const bf16* g) {
  const __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i*>(g));
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
}
// As to_bf16_16. AVX2 has no unsigned compare, but with the sign masked off both sides are
// non-negative int32, so the signed compare decides the same. Every lane holds ≤ 0xffff, so the
// saturating pack (per 128-bit half: low half's 4 lanes, then the high half's) is exact.
MOP_AVX2 inline __m128i to_bf16_8(__m256 x) {
  const __m256i u = _mm256_castps_si256(x);
  const __m256i hi = _mm256_srli_epi32(u, 16);
  const __m256i lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
  const __m256i rounded =
      _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7fff)), lsb), 16);
  const __m256i quiet_nan = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
  const __m256i is_nan = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                            _mm256_set1_epi32(0x7f800000));
  const __m256i r = _mm256_blendv_epi8(rounded, quiet_nan, is_nan);
  return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

MOP_AVX2 inline void store_weights8(bf16* w, __m256 x) {
  _mm_stream_si128(reinterpret_cast<__m128i*>(w), to_bf16_8(x));
}
MOP_AVX2 inline void store_weights8(float* w, __m256 x) {
  _mm256_storeu_ps(w, x);
}

template <class G, class W>
MOP_AVX2 void update_avx2(float* p, float* m, float* v, const G* grad, W* w, bool state, int64_t n,
                          const AdamWConsts& c) {
  const __m256 beta1 = _mm256_set1_ps(c.beta1), beta2 = _mm256_set1_ps(c.beta2);
  const __m256 one_minus_beta1 = _mm256_set1_ps(c.one_minus_beta1);
  const __m256 one_minus_beta2 = _mm256_set1_ps(c.one_minus_beta2);
  const __m256 step_size = _mm256_set1_ps(c.step_size), sqrt_bc2 = _mm256_set1_ps(c.sqrt_bc2);
  const __m256 eps = _mm256_set1_ps(c.eps), decay = _mm256_set1_ps(c.decay);
  const __m256 grad_scale = _mm256_set1_ps(c.grad_scale);
  int64_t i = std::min(n, elements_to_alignment(w, 16));
  update_scalar(p, m, v, grad, w, state, 0, i, c);
  for (; i + 8 <= n; i += 8) {
    const __m256 g = _mm256_mul_ps(load8(grad + i), grad_scale);
    const __m256 mi = _mm256_add_ps(_mm256_mul_ps(beta1, _mm256_loadu_ps(m + i)),
                                    _mm256_mul_ps(one_minus_beta1, g));
    const __m256 vi = _mm256_add_ps(_mm256_mul_ps(beta2, _mm256_loadu_ps(v + i)),
                                    _mm256_mul_ps(one_minus_beta2, _mm256_mul_ps(g, g)));
    const __m256 denom = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), sqrt_bc2), eps);
    const __m256 pi = _mm256_sub_ps(_mm256_mul_ps(_mm256_loadu_ps(p + i), decay),
                                    _mm256_div_ps(_mm256_mul_ps(step_size, mi), denom));
    if (state) {
      _mm256_storeu_ps(p + i, pi);
      _mm256_storeu_ps(m + i, mi);
      _mm256_storeu_ps(v + i, vi);
    }
    if (w) store_weights8(w + i, pi);
  }
  _mm_sfence();
  update_scalar(p, m, v, grad, w, state, i, n, c);
}
#endif  // MOP_HAVE_X86_SIMD

template <class G, class W>
void update_with(SimdIsa isa, const HostAdamWRange& r, W* w, const AdamWConsts& c) {
  const G* grad = static_cast<const G*>(r.grad);
  switch (isa) {
#ifdef MOP_HAVE_X86_SIMD
    case SimdIsa::Avx512:
      return update_avx512(r.master, r.m, r.v, grad, w, r.write_state, r.n, c);
    case SimdIsa::Avx2:
      return update_avx2(r.master, r.m, r.v, grad, w, r.write_state, r.n, c);
#endif
    default:
      return update_scalar(r.master, r.m, r.v, grad, w, r.write_state, 0, r.n, c);
  }
}

template <class G>
void update_grad(SimdIsa isa, const HostAdamWRange& r, const AdamWConsts& c) {
  if (r.weights_f32)
    update_with<G>(isa, r, r.weights_f32, c);
  else
    update_with<G>(isa, r, r.weights, c);
}

void update(SimdIsa isa, const HostAdamWRange& r, const AdamWConsts& c) {
  if (r.grad_dtype == DType::BF16)
    update_grad<bf16>(isa, r, c);
  else
    update_grad<float>(isa, r, c);
}

void check_args(const HostAdamWRange& r, const AdamWArgs& args, SimdIsa isa) {
  MOP_CHECK(simd_isa_supported(isa), "host AdamW: ", simd_isa_name(isa),
            " is not supported by this CPU");
  MOP_CHECK(r.grad_dtype == DType::F32 || r.grad_dtype == DType::BF16, "host AdamW: grad dtype ",
            dtype_name(r.grad_dtype), " (f32 or bf16)");
  MOP_CHECK(r.n >= 0 && (r.n == 0 || (r.master && r.m && r.v && r.grad)),
            "host AdamW: null array for ", r.n, " elements");
  MOP_CHECK(reinterpret_cast<uintptr_t>(r.weights) % alignof(bf16) == 0 &&
                reinterpret_cast<uintptr_t>(r.weights_f32) % alignof(float) == 0,
            "host AdamW: misaligned weights");
  MOP_CHECK(!(r.weights && r.weights_f32), "host AdamW: bf16 and f32 weights at once");
  MOP_CHECK(r.write_state || r.weights || r.weights_f32 || r.n == 0,
            "host AdamW: a pass that writes neither the state nor the weights");
  MOP_CHECK(args.bias_correction1 > 0 && args.bias_correction2 > 0,
            "host AdamW: bias corrections must be positive (1 − β^step, step ≥ 1)");
}

}  // namespace

bool simd_isa_supported(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::Scalar:
      return true;
#ifdef MOP_HAVE_X86_SIMD
    // __builtin_cpu_supports also checks that the OS saves the wide registers (XCR0).
    case SimdIsa::Avx2:
      return __builtin_cpu_supports("avx2");
    case SimdIsa::Avx512:
      return __builtin_cpu_supports("avx512f");
#endif
    default:
      return false;
  }
}

SimdIsa best_simd_isa() {
  static const SimdIsa best = simd_isa_supported(SimdIsa::Avx512) ? SimdIsa::Avx512
                              : simd_isa_supported(SimdIsa::Avx2) ? SimdIsa::Avx2
                                                                  : SimdIsa::Scalar;
  return best;
}

std::string_view simd_isa_name(SimdIsa isa) {
  switch (isa) {
    case SimdIsa::Scalar:
      return "scalar";
    case SimdIsa::Avx2:
      return "avx2";
    case SimdIsa::Avx512:
      return "avx512";
  }
  return "?";
}

HostAdamWRange HostAdamWRange::slice(int64_t begin, int64_t end) const {
  MOP_CHECK(0 <= begin && begin <= end && end <= n, "host AdamW slice [", begin, ",", end, ") of ",
            n);
  const size_t grad_size = dtype_size(grad_dtype);
  HostAdamWRange s = *this;
  s.master = master + begin;
  s.m = m + begin;
  s.v = v + begin;
  s.grad = static_cast<const char*>(grad) + size_t(begin) * grad_size;
  s.weights = weights ? weights + begin : nullptr;
  s.weights_f32 = weights_f32 ? weights_f32 + begin : nullptr;
  s.n = end - begin;
  return s;
}

HostAdamWRange host_adamw_range(Tensor master, Tensor m, Tensor v, const Tensor& grad,
                                Tensor weights) {
  const int64_t n = master.numel();
  const bool has_weights = weights.data != nullptr;
  for (const Tensor* t : std::initializer_list<const Tensor*>{&master, &m, &v, &grad, &weights}) {
    if (t == &weights && !has_weights) continue;
    MOP_CHECK(t->device == Device::CPU, "host AdamW: tensors must be in host memory");
    MOP_CHECK(t->numel() == n && (t->data || n == 0), "host AdamW: ", t->shape_str(), " vs master ",
              master.shape_str());
  }
  MOP_CHECK(master.dtype == DType::F32 && m.dtype == DType::F32 && v.dtype == DType::F32,
            "host AdamW: master, m and v must be f32");
  MOP_CHECK(!has_weights || weights.dtype == DType::BF16 || weights.dtype == DType::F32,
            "host AdamW: weights must be bf16 or f32, not ", dtype_name(weights.dtype));
  HostAdamWRange r;
  r.master = master.ptr<float>();
  r.m = m.ptr<float>();
  r.v = v.ptr<float>();
  r.grad = grad.data;
  r.grad_dtype = grad.dtype;
  if (has_weights && weights.dtype == DType::BF16) r.weights = weights.ptr<bf16>();
  if (has_weights && weights.dtype == DType::F32) r.weights_f32 = weights.ptr<float>();
  r.n = n;
  return r;
}

void host_adamw_update(const HostAdamWRange& range, const AdamWArgs& args, SimdIsa isa) {
  check_args(range, args, isa);
  update(isa, range, adamw_consts(args));
}

ThreadPool::Ticket host_adamw_submit(ThreadPool& pool, const HostAdamWRange& range,
                                     const AdamWArgs& args, SimdIsa isa) {
  check_args(range, args, isa);
  const AdamWConsts c = adamw_consts(args);
  return pool.submit(range.n, kHostAdamWChunk, [range, c, isa](int64_t begin, int64_t end) {
    update(isa, range.slice(begin, end), c);
  });
}

}  // namespace mop
