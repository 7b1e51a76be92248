// Element types and host-side bf16 conversion.
// bf16 is the top half of an IEEE fp32; rounding is to nearest-even (as __float2bfloat16_rn), NaN
// stays NaN. The host type `bf16` is layout-compatible with CUDA's __nv_bfloat16.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string_view>

namespace mop {

enum class DType : uint8_t { F32, F64, BF16, I32, I64, U8, U16, U32 };

constexpr size_t dtype_size(DType t) {
  switch (t) {
    case DType::F64:
    case DType::I64: return 8;
    case DType::F32:
    case DType::I32:
    case DType::U32: return 4;
    case DType::BF16:
    case DType::U16: return 2;
    case DType::U8: return 1;
  }
  return 0;
}

constexpr std::string_view dtype_name(DType t) {
  switch (t) {
    case DType::F32: return "f32";
    case DType::F64: return "f64";
    case DType::BF16: return "bf16";
    case DType::I32: return "i32";
    case DType::I64: return "i64";
    case DType::U8: return "u8";
    case DType::U16: return "u16";
    case DType::U32: return "u32";
  }
  return "?";
}

constexpr bool dtype_is_float(DType t) {
  return t == DType::F32 || t == DType::F64 || t == DType::BF16;
}

// Accumulation dtype for a compute dtype: statistics, router probabilities and losses are kept in
// fp32, or fp64 when the whole computation runs in fp64 (gradient checks).
constexpr DType acc_dtype(DType compute) { return compute == DType::F64 ? DType::F64 : DType::F32; }

struct bf16 {
  uint16_t bits = 0;
};

inline float bf16_to_float(bf16 h) {
  uint32_t u = uint32_t(h.bits) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

inline bf16 float_to_bf16(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7f800000u) == 0x7f800000u && (u & 0x007fffffu)) return bf16{uint16_t((u >> 16) | 0x40)};
  u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest, ties to even
  return bf16{uint16_t(u >> 16)};
}

// Round a float through bf16 (used to build test inputs that are exact in both precisions).
inline float round_bf16(float f) { return bf16_to_float(float_to_bf16(f)); }

}  // namespace mop
