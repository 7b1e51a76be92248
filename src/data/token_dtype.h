// TokenDType: the integer element types token files are stored in (Megatron's integer dtypes plus
// uint32 for flat files), with their sizes and names. Token files are little-endian; so is every
// host this engine targets, which lets readers index the mapped arrays directly.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string_view>

#include "core/error.h"

namespace mop {

static_assert(std::endian::native == std::endian::little, "token files are read in place as LE");

enum class TokenDType : uint8_t { U8, I16, U16, I32, U32, I64 };

constexpr size_t token_dtype_size(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
      return 1;
    case TokenDType::I16:
    case TokenDType::U16:
      return 2;
    case TokenDType::I32:
    case TokenDType::U32:
      return 4;
    case TokenDType::I64:
      return 8;
  }
  return 0;
}

constexpr std::string_view token_dtype_name(TokenDType t) {
  switch (t) {
    case TokenDType::U8:
      return "uint8";
    case TokenDType::I16:
      return "int16";
    case TokenDType::U16:
      return "uint16";
    case TokenDType::I32:
      return "int32";
    case TokenDType::U32:
      return "uint32";
    case TokenDType::I64:
      return "int64";
  }
  return "?";
}

// The dtypes a flat token file may have: "uint16" or "uint32".
inline TokenDType parse_flat_dtype(std::string_view name) {
  if (name == "uint16") return TokenDType::U16;
  if (name == "uint32") return TokenDType::U32;
  throw_user_error("flat token dtype must be uint16 or uint32 (got \"", name, "\")");
}

}  // namespace mop
