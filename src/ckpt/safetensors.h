// safetensors files (the Hugging Face tensor format): a streaming writer that hashes while it
// writes, and a validating reader over a read-only memory map.
//
// Layout: u64 little-endian N | N bytes of UTF-8 JSON header | data buffer.
//   header: {"__metadata__": {str: str} (optional),
//            "<name>": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...}
//   offsets are relative to the start of the data buffer; each tensor is contiguous, row-major,
//   little-endian; shape [] is a scalar, a zero in the shape makes an empty tensor (begin == end).
// We write what the reference writer (huggingface/safetensors) writes, byte for byte: compact
// JSON, "__metadata__" first, header padded with spaces to a multiple of 8, tensors ordered by
// dtype (widest first, the reference's enum order) then name, data in header order with no gaps.
// With that order every tensor starts at a multiple of its element size.
#pragma once

#include <cstdint>
#include <filesystem>
#include <functional>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "ckpt/sha256.h"
#include "core/mapped_file.h"
#include "core/dtype.h"
#include "core/tensor.h"

namespace mop {

// "F32", "F64", "BF16", "I32", "I64", "U8", "U16", "U32".
std::string_view safetensors_dtype(DType t);
// nullopt for strings that are not one of our dtypes (F16, I8, BOOL, F8_E4M3, ... included).
std::optional<DType> dtype_from_safetensors(std::string_view s);

using SafetensorsMetadata = std::map<std::string, std::string>;

// One tensor to write: a host view (contiguous, row-major).
struct SafetensorsEntry {
  std::string name;
  Tensor tensor;
};

// Writes `path` (created or truncated), streaming each tensor from its memory (no staging copy),
// hashing the bytes as they go out, and fsyncing before close. Returns the file's size and
// SHA-256. Names must be unique, non-empty and not "__metadata__", tensors on the host
// (MOP_CHECK: caller bugs). On failure the partial file is removed and the UserError rethrown.
FileDigest write_safetensors(const std::filesystem::path& path,
                             const std::vector<SafetensorsEntry>& tensors,
                             const SafetensorsMetadata& metadata = {});

// One tensor of a file being read; `data` points into the read-only mapping.
struct SafetensorsTensor {
  DType dtype = DType::F32;
  std::vector<int64_t> shape;
  const void* data = nullptr;  // aligned to the element size in files written in reference order
  uint64_t bytes = 0;
  uint64_t offset = 0;  // data_offsets[0]: position in the data buffer

  int64_t numel() const;
};

using SafetensorsTensors = std::map<std::string, SafetensorsTensor, std::less<>>;

// The checks SafetensorsFile's constructor makes, over a file image of `size` bytes already in
// memory (`source` names it in errors): fills `tensors`, whose data pointers point into `base`, and
// `metadata`. The fuzz target fuzz/safetensors_fuzz.cpp feeds it bytes directly.
void parse_safetensors(const uint8_t* base, uint64_t size, const std::string& source,
                       SafetensorsTensors& tensors, SafetensorsMetadata& metadata);

// An open .safetensors file. The constructor maps the file and validates all of its header;
// anything wrong is a UserError naming the file and the problem: too short, header length past
// the end of the file or over 100 MB, invalid JSON, unknown or unsupported dtype, bad shape,
// shape × dtype size ≠ end − begin, offsets outside the data buffer, overlapping tensors, gaps or
// trailing bytes (the reference reader rejects those too), ill-typed __metadata__.
class SafetensorsFile {
 public:
  explicit SafetensorsFile(const std::filesystem::path& path);

  const std::filesystem::path& path() const { return path_; }
  uint64_t file_size() const { return file_.size(); }
  const SafetensorsTensors& tensors() const { return tensors_; }
  const SafetensorsMetadata& metadata() const { return metadata_; }

  // nullptr when the file has no tensor of that name.
  const SafetensorsTensor* find(std::string_view name) const;
  // UserError "<path>: no tensor 'name'" when missing.
  const SafetensorsTensor& at(std::string_view name) const;
  // A host Tensor view of the mapped data (read only: writing through it faults). UserError for a
  // tensor of more than Tensor::kMaxDims dims.
  Tensor view(std::string_view name) const;

 private:
  std::filesystem::path path_;
  MappedFile file_;
  SafetensorsTensors tensors_;
  SafetensorsMetadata metadata_;
};

}  // namespace mop
