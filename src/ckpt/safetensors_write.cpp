// safetensors writer (and the dtype names shared with the reader): builds the header exactly as
// the reference writer does, then streams header and tensors through one SHA-256 into the file.
#include <algorithm>
#include <bit>
#include <numeric>

#include "ckpt/file_io.h"
#include "ckpt/json.h"
#include "ckpt/safetensors.h"
#include "core/error.h"

namespace mop {

static_assert(std::endian::native == std::endian::little, "safetensors data is little-endian");

std::string_view safetensors_dtype(DType t) {
  switch (t) {
    case DType::F32:
      return "F32";
    case DType::F64:
      return "F64";
    case DType::BF16:
      return "BF16";
    case DType::I32:
      return "I32";
    case DType::I64:
      return "I64";
    case DType::U8:
      return "U8";
    case DType::U16:
      return "U16";
    case DType::U32:
      return "U32";
  }
  MOP_UNREACHABLE("dtype ", int(t));
}

std::optional<DType> dtype_from_safetensors(std::string_view s) {
  for (DType t : {DType::F32, DType::F64, DType::BF16, DType::I32, DType::I64, DType::U8,
                  DType::U16, DType::U32})
    if (s == safetensors_dtype(t)) return t;
  return std::nullopt;
}

namespace {

// Position in the reference implementation's `Dtype` enum (BOOL, F4, F6_E2M3, F6_E3M2, U8, I8,
// F8_E5M2, F8_E4M3, F8_E8M0, I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64). It writes
// tensors by descending enum position, then by name: widest first, so every offset stays a
// multiple of each tensor's element size.
int reference_dtype_rank(DType t) {
  switch (t) {
    case DType::U8:
      return 4;
    case DType::U16:
      return 10;
    case DType::BF16:
      return 12;
    case DType::I32:
      return 13;
    case DType::U32:
      return 14;
    case DType::F32:
      return 15;
    case DType::F64:
      return 17;
    case DType::I64:
      return 18;
  }
  MOP_UNREACHABLE("dtype ", int(t));
}

// Hash and write in blocks this size: the block is still in cache when write() copies it.
constexpr size_t kStreamBlock = size_t(4) << 20;

// Header text (unpadded) for tensors in `order`, which is also the data order.
std::string build_header(const std::vector<SafetensorsEntry>& tensors,
                         const std::vector<size_t>& order, const SafetensorsMetadata& metadata) {
  std::string h = "{";
  if (!metadata.empty()) {
    h += "\"__metadata__\":{";
    bool first = true;
    for (const auto& [k, v] : metadata) {
      if (!first) h += ',';
      first = false;
      json_append_string(h, k);
      h += ':';
      json_append_string(h, v);
    }
    h += "},";
  }
  uint64_t offset = 0;
  for (size_t i : order) {
    const Tensor& t = tensors[i].tensor;
    json_append_string(h, tensors[i].name);
    h += ":{\"dtype\":\"";
    h += safetensors_dtype(t.dtype);
    h += "\",\"shape\":[";
    for (int d = 0; d < t.ndim; ++d) {
      if (d) h += ',';
      h += std::to_string(t.shape[d]);
    }
    uint64_t end = offset + t.bytes();
    h += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(end) + "]},";
    offset = end;
  }
  if (h.back() == ',')
    h.back() = '}';
  else
    h += '}';
  return h;
}

}  // namespace

FileDigest write_safetensors(const std::filesystem::path& path,
                             const std::vector<SafetensorsEntry>& tensors,
                             const SafetensorsMetadata& metadata) {
  std::vector<size_t> order(tensors.size());
  std::iota(order.begin(), order.end(), size_t(0));
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) {
    int ra = reference_dtype_rank(tensors[a].tensor.dtype),
        rb = reference_dtype_rank(tensors[b].tensor.dtype);
    if (ra != rb) return ra > rb;
    return tensors[a].name <
           tensors[b].name;  // std::string compares bytes as unsigned, as Rust does
  });
  for (size_t k = 0; k < order.size(); ++k) {
    const SafetensorsEntry& e = tensors[order[k]];
    MOP_CHECK(!e.name.empty() && e.name != "__metadata__", "bad tensor name '", e.name, "' for ",
              path.string());
    MOP_CHECK(k == 0 || e.name != tensors[order[k - 1]].name, "duplicate tensor '", e.name,
              "' for ", path.string());
    MOP_CHECK(e.tensor.device == Device::CPU, "tensor '", e.name, "' is not on the host");
    MOP_CHECK(e.tensor.defined(), "tensor '", e.name, "' has no data");
  }

  std::string header = build_header(tensors, order, metadata);
  header.append((8 - header.size() % 8) % 8, ' ');
  uint8_t size_le[8];
  for (int i = 0; i < 8; ++i) size_le[i] = uint8_t(uint64_t(header.size()) >> (8 * i));

  try {
    OutFile f(path);
    Sha256 hash;
    auto put = [&](const void* p, size_t n) {
      hash.update(p, n);
      f.write(p, n);
    };
    put(size_le, 8);
    put(header.data(), header.size());
    for (size_t i : order) {
      const auto* p = static_cast<const uint8_t*>(tensors[i].tensor.data);
      for (size_t left = tensors[i].tensor.bytes(); left > 0;) {
        size_t n = std::min(left, kStreamBlock);
        put(p, n);
        p += n;
        left -= n;
      }
    }
    uint64_t bytes = f.bytes_written();
    f.sync_and_close();
    return FileDigest{bytes, hash.finish_hex()};
  } catch (...) {
    std::error_code ec;
    std::filesystem::remove(path, ec);
    throw;
  }
}

}  // namespace mop
