// IndexedDatasetWriter: tokens are encoded to the dataset dtype and appended to <prefix>.bin.tmp as
// they arrive; lengths stay in memory (4 bytes per document) until finish() writes the .idx.
#include "data/indexed_dataset_writer.h"

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <limits>
#include <string>

#include "core/error.h"

namespace mop {
namespace {
std::string tmp_path(const std::string& path) {
  return path + ".tmp";
}

std::FILE* create_file(const std::string& final_path) {
  std::FILE* f = std::fopen(tmp_path(final_path).c_str(), "wb");
  MOP_USER_CHECK(f, "cannot write ", final_path, ": ", std::strerror(errno));
  return f;
}

template <class T>
void encode(std::span<const uint32_t> tokens, TokenDType dtype, std::vector<uint8_t>& out) {
  out.resize(tokens.size() * sizeof(T));
  T* dst = reinterpret_cast<T*>(out.data());
  for (size_t i = 0; i < tokens.size(); ++i) {
    MOP_CHECK(tokens[i] <= uint64_t(std::numeric_limits<T>::max()), "token ", tokens[i],
              " does not fit a ", token_dtype_name(dtype), " dataset");
    dst[i] = T(tokens[i]);
  }
}
}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(std::string_view prefix, TokenDType dtype)
    : paths_(megatron_paths(prefix)), dtype_(dtype) {
  (void)megatron_code(dtype);  // rejects uint32, which Megatron cannot store
  bin_ = create_file(paths_.bin);
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
  if (bin_) std::fclose(bin_);
  if (!finished_) {
    std::error_code ignored;
    std::filesystem::remove(tmp_path(paths_.bin), ignored);
    std::filesystem::remove(tmp_path(paths_.idx), ignored);
  }
}

void IndexedDatasetWriter::write(std::FILE* f, const std::string& what, const void* data,
                                 size_t bytes) {
  if (bytes == 0) return;
  MOP_USER_CHECK(std::fwrite(data, 1, bytes, f) == bytes, "cannot write ", what, ": ",
                 std::strerror(errno));
  num_bytes_written_ += int64_t(bytes);
}

void IndexedDatasetWriter::add_tokens(std::span<const uint32_t> tokens) {
  MOP_CHECK(!finished_, "add_tokens after finish");
  switch (dtype_) {
    case TokenDType::U8:
      encode<uint8_t>(tokens, dtype_, encode_buffer_);
      break;
    case TokenDType::I16:
      encode<int16_t>(tokens, dtype_, encode_buffer_);
      break;
    case TokenDType::U16:
      encode<uint16_t>(tokens, dtype_, encode_buffer_);
      break;
    case TokenDType::I32:
      encode<int32_t>(tokens, dtype_, encode_buffer_);
      break;
    case TokenDType::I64:
      encode<int64_t>(tokens, dtype_, encode_buffer_);
      break;
    case TokenDType::U32:
      MOP_UNREACHABLE();
  }
  write(bin_, paths_.bin, encode_buffer_.data(), encode_buffer_.size());
  document_tokens_ += int64_t(tokens.size());
  num_tokens_ += int64_t(tokens.size());
}

void IndexedDatasetWriter::end_document() {
  MOP_CHECK(!finished_, "end_document after finish");
  MOP_USER_CHECK(document_tokens_ <= std::numeric_limits<int32_t>::max(), "document ",
                 lengths_.size(), " has ", document_tokens_,
                 " tokens; Megatron stores sequence lengths as int32 (at most 2147483647)");
  lengths_.push_back(int32_t(document_tokens_));
  document_tokens_ = 0;
}

void IndexedDatasetWriter::finish() {
  MOP_CHECK(!finished_, "finish called twice");
  MOP_CHECK(document_tokens_ == 0, document_tokens_, " tokens added after the last end_document");
  int close_rc = std::fclose(bin_);
  bin_ = nullptr;
  MOP_USER_CHECK(close_rc == 0, "cannot write ", paths_.bin, ": ", std::strerror(errno));

  const uint64_t num_seq = lengths_.size(), num_doc = lengths_.size() + 1;
  std::vector<int64_t> pointers(num_seq), documents(num_doc);
  int64_t offset = 0;
  for (uint64_t i = 0; i < num_seq; ++i) {
    pointers[i] = offset;
    offset += int64_t(lengths_[i]) * int64_t(token_dtype_size(dtype_));
  }
  for (uint64_t i = 0; i < num_doc; ++i) documents[i] = int64_t(i);
  const uint8_t code = megatron_code(dtype_);

  std::FILE* idx = create_file(paths_.idx);
  try {
    write(idx, paths_.idx, kMegatronMagic, sizeof(kMegatronMagic));
    write(idx, paths_.idx, &kMegatronVersion, 8);
    write(idx, paths_.idx, &code, 1);
    write(idx, paths_.idx, &num_seq, 8);
    write(idx, paths_.idx, &num_doc, 8);
    write(idx, paths_.idx, lengths_.data(), 4 * num_seq);
    write(idx, paths_.idx, pointers.data(), 8 * num_seq);
    write(idx, paths_.idx, documents.data(), 8 * num_doc);
  } catch (...) {
    std::fclose(idx);
    throw;
  }
  MOP_USER_CHECK(std::fclose(idx) == 0, "cannot write ", paths_.idx, ": ", std::strerror(errno));

  // The .idx goes into place last: a reader that sees it also sees the complete .bin.
  std::error_code ec;
  std::filesystem::rename(tmp_path(paths_.bin), paths_.bin, ec);
  if (!ec) std::filesystem::rename(tmp_path(paths_.idx), paths_.idx, ec);
  MOP_USER_CHECK(!ec, "cannot move ", paths_.prefix, ".{bin,idx} into place: ", ec.message());
  finished_ = true;
}

}  // namespace mop
