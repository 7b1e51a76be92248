// Megatron indexed dataset: dtype codes, path resolution and .idx validation. Every check names the
// file and the offending entry, so a broken or mismatched dataset is diagnosed from one line.
#include "data/megatron_format.h"

#include "core/error.h"

namespace mop {

TokenDType megatron_dtype_from_code(int code, const std::string& idx_path) {
  switch (code) {
    case 1:
      return TokenDType::U8;
    case 3:
      return TokenDType::I16;
    case 4:
      return TokenDType::I32;
    case 5:
      return TokenDType::I64;
    case 8:
      return TokenDType::U16;
    case 2:
    case 6:
    case 7: {
      const char* name = code == 2 ? "int8" : code == 6 ? "float64" : "float32";
      throw_user_error(idx_path, ": unsupported dtype code ", code, " (", name,
                       "); token ids need 1 uint8, 3 int16, 4 int32, 5 int64 or 8 uint16");
    }
    default:
      throw_user_error(idx_path, ": unknown dtype code ", code,
                       " (Megatron codes are 1..8; token ids need 1, 3, 4, 5 or 8)");
  }
}

uint8_t megatron_code(TokenDType dtype) {
  switch (dtype) {
    case TokenDType::U8:
      return 1;
    case TokenDType::I16:
      return 3;
    case TokenDType::I32:
      return 4;
    case TokenDType::I64:
      return 5;
    case TokenDType::U16:
      return 8;
    case TokenDType::U32:
      break;
  }
  MOP_UNREACHABLE("Megatron has no dtype code for ", token_dtype_name(dtype));
}

TokenDType megatron_dtype_for_vocab(int64_t vocab_size) {
  return vocab_size < kMegatronUint16VocabLimit ? TokenDType::U16 : TokenDType::I32;
}

MegatronPaths megatron_paths(std::string_view path) {
  std::string prefix(path);
  if (path.ends_with(".bin") || path.ends_with(".idx")) prefix.resize(prefix.size() - 4);
  return {prefix, prefix + ".bin", prefix + ".idx"};
}

MegatronIndex::MegatronIndex(const std::string& idx_path, uint64_t bin_bytes,
                             const std::string& bin_path)
    : file_(idx_path, MapAdvice::Sequential) {
  validate_header();
  validate_sequences(bin_bytes, bin_path);
  validate_documents();
}

void MegatronIndex::validate_header() {
  const std::string& p = path();
  size_t size = file_.size();
  MOP_USER_CHECK(size > 0, p, ": empty file (expected a Megatron index)");
  size_t magic_bytes = size < sizeof(kMegatronMagic) ? size : sizeof(kMegatronMagic);
  MOP_USER_CHECK(std::memcmp(file_.data(), kMegatronMagic, magic_bytes) == 0, p,
                 ": bad magic: expected \"MMIDIDX\\0\\0\" (is this a Megatron .idx file?)");
  MOP_USER_CHECK(size >= kMegatronHeaderBytes, p, ": truncated: the file ends inside the ",
                 kMegatronHeaderBytes, "-byte header (it has ", size, " bytes)");
  uint64_t version = load<uint64_t>(9);
  MOP_USER_CHECK(version == kMegatronVersion, p, ": unsupported version ", version,
                 " (this reader knows version ", kMegatronVersion, ")");
  dtype_ = megatron_dtype_from_code(int(file_.data()[17]), p);
  uint64_t num_seq = load<uint64_t>(18), num_doc = load<uint64_t>(26);

  // Compare by division so absurd counts from a corrupt header cannot overflow.
  uint64_t avail = size - kMegatronHeaderBytes;
  MOP_USER_CHECK(num_seq <= avail / 4, p, ": truncated: header says ", num_seq,
                 " sequences but the file ends after ", avail / 4, " sequence lengths");
  avail -= 4 * num_seq;
  MOP_USER_CHECK(num_seq <= avail / 8, p, ": truncated: header says ", num_seq,
                 " sequences but the file ends after ", avail / 8, " pointers");
  avail -= 8 * num_seq;
  MOP_USER_CHECK(num_doc <= avail / 8, p, ": truncated: header says ", num_doc,
                 " document indices but the file ends after ", avail / 8);
  avail -= 8 * num_doc;
  if (avail > 0) {
    // Megatron's multimodal variant appends one int8 mode per sequence.
    const char* hint = avail == num_seq ? "; the extra bytes look like the sequence modes of a "
                                          "multimodal index, which is not supported"
                                        : "";
    throw_user_error(p, ": oversized: header says ", num_seq, " sequences and ", num_doc,
                     " document indices (", size - avail, " bytes) but the file has ", size,
                     " bytes", hint);
  }
  num_sequences_ = int64_t(num_seq);
  num_document_indices_ = int64_t(num_doc);
}

void MegatronIndex::validate_sequences(uint64_t bin_bytes, const std::string& bin_path) {
  const std::string& p = path();
  const uint64_t item = token_dtype_size(dtype_);
  // The token stream is the .bin read front to back, so sequences must tile it in index order
  // (Megatron's writer and merge tool always produce this layout).
  uint64_t end = 0;
  for (int64_t i = 0; i < num_sequences_; ++i) {
    int32_t len = sequence_length(i);
    int64_t ptr = sequence_pointer(i);
    MOP_USER_CHECK(len >= 0, p, ": sequence ", i, " has negative length ", len);
    MOP_USER_CHECK(ptr >= 0 && uint64_t(ptr) <= bin_bytes, p, ": pointer of sequence ", i,
                   " (byte ", ptr, ") is past the end of ", bin_path, " (", bin_bytes, " bytes)");
    MOP_USER_CHECK(uint64_t(ptr) == end, p, ": sequence ", i, " starts at byte ", ptr,
                   " but the sequences before it end at byte ", end,
                   " (only contiguous sequences in index order are supported)");
    end += uint64_t(len) * item;
    MOP_USER_CHECK(end <= bin_bytes, p, ": sequence ", i, " (", len, " tokens from byte ", ptr,
                   ") runs past the end of ", bin_path, " (", bin_bytes, " bytes)");
  }
  MOP_USER_CHECK(end == bin_bytes, bin_path, ": has ", bin_bytes, " bytes but ", p, " describes ",
                 end, " (do the .bin and .idx belong together?)");
  num_tokens_ = int64_t(end / item);
}

void MegatronIndex::validate_documents() const {
  const std::string& p = path();
  MOP_USER_CHECK(num_document_indices_ >= 1, p,
                 ": has no document indices (expected at least the leading 0)");
  MOP_USER_CHECK(document_index(0) == 0, p, ": document index 0 is ", document_index(0),
                 ", expected 0");
  for (int64_t i = 1; i < num_document_indices_; ++i) {
    int64_t prev = document_index(i - 1), cur = document_index(i);
    MOP_USER_CHECK(cur >= prev, p, ": document indices decrease: entry ", i, " is ", cur, " after ",
                   prev);
  }
  int64_t last = document_index(num_document_indices_ - 1);
  MOP_USER_CHECK(last == num_sequences_, p, ": the last document index is ", last,
                 " but there are ", num_sequences_, " sequences");
}

}  // namespace mop
