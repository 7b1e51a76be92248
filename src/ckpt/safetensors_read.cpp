// safetensors reader: maps the file read-only and validates every header field before exposing
// pointers into the data buffer, so a corrupt or hostile file is a UserError, never a wild read.

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "ckpt/json.h"
#include "ckpt/safetensors.h"
#include "core/error.h"

namespace mop {
namespace {

// The reference reader's limit; real headers are at most a few MB (tens of thousands of tensors).
constexpr uint64_t kMaxHeaderBytes = 100'000'000;

// safetensors dtypes that exist but that mop has no DType for: named as "unsupported", not
// "unknown", so the user learns the file is fine and the type is the problem.
bool is_other_safetensors_dtype(std::string_view s) {
  for (std::string_view k : {"BOOL", "F4", "F6_E2M3", "F6_E3M2", "I8", "F8_E5M2", "F8_E4M3",
                             "F8_E8M0", "I16", "F16", "C64", "U64"})
    if (s == k) return true;
  return false;
}

struct Span {
  uint64_t begin, end;
  const std::string* name;
};

}  // namespace

// Validates the header and data layout of a file of `size` bytes at `base`.
void parse_safetensors(const uint8_t* base, uint64_t size, const std::string& src,
                       SafetensorsTensors& tensors, SafetensorsMetadata& metadata) {
  if (size < 8)
    throw_user_error(src, ": file too short (", size, " bytes) for a safetensors header");
  uint64_t n = 0;
  for (int i = 0; i < 8; ++i) n |= uint64_t(base[i]) << (8 * i);
  if (n > size - 8)
    throw_user_error(src, ": header length ", n, " runs past the end of the file (", size,
                     " bytes; truncated or not a safetensors file?)");
  if (n > kMaxHeaderBytes)
    throw_user_error(src, ": header length ", n, " exceeds the limit of ", kMaxHeaderBytes);
  if (n < 2 || base[8] != '{') throw_user_error(src, ": header is not a JSON object");
  const std::string where = src + ": header";
  Json header = parse_json(std::string_view(reinterpret_cast<const char*>(base + 8), n), where);
  const uint64_t data_size = size - 8 - n;
  const uint8_t* data = base + 8 + n;

  std::vector<Span> spans;
  for (const auto& [name, entry] : header.as_object(where)) {
    if (name == "__metadata__") {
      for (const auto& [k, v] : entry.as_object(where + ": __metadata__"))
        metadata[k] = v.as_string(where + ": __metadata__: " + k);
      continue;
    }
    const std::string tw = src + ": tensor '" + name + "'";
    entry.as_object(tw);
    const std::string& dtype_str = entry.at("dtype", tw).as_string(tw + ": dtype");
    std::optional<DType> dtype = dtype_from_safetensors(dtype_str);
    if (!dtype) {
      if (is_other_safetensors_dtype(dtype_str))
        throw_user_error(tw, ": dtype ", dtype_str,
                         " is not supported (mop reads F32, F64, BF16, I32, I64, U8, U16, U32)");
      throw_user_error(tw, ": unknown dtype '", dtype_str, "'");
    }
    SafetensorsTensor t;
    t.dtype = *dtype;
    // `extent`, the product of the dims other than 0, must fit int64: numel() and Tensor multiply
    // the dims in order, so [2, 2^62, 0] (an empty tensor) would overflow them before the 0.
    uint64_t numel = 1, extent = 1;
    for (const Json& d : entry.at("shape", tw).as_array(tw + ": shape")) {
      int64_t dim = d.as_int64(tw + ": shape");
      if (dim < 0) throw_user_error(tw, ": negative dimension ", dim, " in shape");
      t.shape.push_back(dim);
      if (dim != 0 &&
          (__builtin_mul_overflow(extent, uint64_t(dim), &extent) || extent > uint64_t(INT64_MAX)))
        throw_user_error(tw, ": shape ", shape_str(t.shape), "... has too many elements");
      numel *= uint64_t(dim);  // at most `extent`
    }
    const Json::Array& offsets = entry.at("data_offsets", tw).as_array(tw + ": data_offsets");
    if (offsets.size() != 2) throw_user_error(tw, ": data_offsets must be [begin, end]");
    uint64_t begin = offsets[0].as_uint64(tw + ": data_offsets"),
             end = offsets[1].as_uint64(tw + ": data_offsets");
    if (begin > end)
      throw_user_error(tw, ": data_offsets [", begin, ", ", end, "] end before they begin");
    if (end > data_size)
      throw_user_error(tw, ": data_offsets [", begin, ", ", end, "] run past the data buffer (",
                       data_size, " bytes; truncated file?)");
    uint64_t bytes;
    if (__builtin_mul_overflow(numel, uint64_t(dtype_size(t.dtype)), &bytes) ||
        bytes != end - begin)
      throw_user_error(tw, ": shape ", shape_str(t.shape), " of ", dtype_str, " needs ", numel,
                       " × ", dtype_size(t.dtype), " bytes but data_offsets [", begin, ", ", end,
                       "] hold ", end - begin);
    t.data = data + begin;
    t.bytes = bytes;
    t.offset = begin;
    auto [it, inserted] = tensors.emplace(name, std::move(t));
    MOP_CHECK(inserted, "duplicate key passed the JSON reader: ", name);
    spans.push_back({begin, end, &it->first});
  }

  // The tensors must tile the data buffer exactly: overlap means two tensors share bytes, a gap
  // or a tail means bytes nobody owns. The reference reader rejects all three.
  std::sort(spans.begin(), spans.end(), [](const Span& a, const Span& b) {
    return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
  });
  uint64_t cursor = 0;
  const std::string* prev = nullptr;
  for (const Span& s : spans) {
    if (s.begin < cursor)
      throw_user_error(src, ": tensors '", *prev, "' and '", *s.name,
                       "' overlap in the data buffer");
    if (s.begin > cursor)
      throw_user_error(src, ": ", s.begin - cursor,
                       " unused bytes in the data buffer before tensor '", *s.name, "'");
    cursor = s.end;
    prev = s.name;
  }
  if (cursor != data_size)
    throw_user_error(src, ": ", data_size - cursor,
                     " bytes after the last tensor (file has trailing data)");
}

int64_t SafetensorsTensor::numel() const {
  int64_t n = 1;
  for (int64_t d : shape) n *= d;
  return n;
}

SafetensorsFile::SafetensorsFile(const std::filesystem::path& path)
    : path_(path), file_(path.string()) {
  static const uint8_t kEmpty[1] = {0};
  parse_safetensors(file_.data() ? file_.data() : kEmpty, file_.size(), path.string(), tensors_,
                    metadata_);
}

const SafetensorsTensor* SafetensorsFile::find(std::string_view name) const {
  auto it = tensors_.find(name);
  return it == tensors_.end() ? nullptr : &it->second;
}

const SafetensorsTensor& SafetensorsFile::at(std::string_view name) const {
  const SafetensorsTensor* t = find(name);
  if (!t) throw_user_error(path_.string(), ": no tensor '", name, "'");
  return *t;
}

Tensor SafetensorsFile::view(std::string_view name) const {
  const SafetensorsTensor& st = at(name);
  if (st.shape.size() > size_t(Tensor::kMaxDims))
    throw_user_error(path_.string(), ": tensor '", name, "' has ", st.shape.size(),
                     " dims (at most ", Tensor::kMaxDims, " supported)");
  Tensor t;
  t.data = const_cast<void*>(st.data);  // PROT_READ mapping: Tensor has no const flavour
  t.dtype = st.dtype;
  t.device = Device::CPU;
  t.ndim = int(st.shape.size());
  for (int i = 0; i < t.ndim; ++i) t.shape[i] = st.shape[size_t(i)];
  return t;
}

}  // namespace mop
