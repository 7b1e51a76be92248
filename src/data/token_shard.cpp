// TokenShard: opening (format detection, flat-file checks) and the checked uint32 reads. Reads
// widen in one vectorisable pass and only look for the offending position when a check failed.
#include "data/token_shard.h"

#include <filesystem>

#include "core/error.h"

namespace mop {
namespace {
// Samples read windows of S+1 contiguous tokens (kilobytes or more) in shuffled order. The
// default readahead serves a window in few large reads; MADV_RANDOM would fault it in page by page.
constexpr MapAdvice kTokenAdvice = MapAdvice::Normal;

template <class T>
bool copy_widened(const T* src, int64_t count, uint32_t* out, int64_t vocab_size) {
  bool bad = false;
  for (int64_t i = 0; i < count; ++i) {
    int64_t v = int64_t(src[i]);
    bad |= (v < 0) | (v >= vocab_size);
    out[i] = uint32_t(v);
  }
  return bad;
}

// Index of the first token outside [0, vocab_size), or -1.
template <class T>
int64_t first_out_of_vocab(const T* src, int64_t count, int64_t vocab_size) {
  for (int64_t i = 0; i < count; ++i) {
    int64_t v = int64_t(src[i]);
    if (v < 0 || v >= vocab_size) return i;
  }
  return -1;
}

// Calls fn(typed pointer) for the shard's dtype.
template <class Fn>
decltype(auto) visit_tokens(const uint8_t* data, TokenDType dtype, Fn&& fn) {
  switch (dtype) {
    case TokenDType::U8:
      return fn(reinterpret_cast<const uint8_t*>(data));
    case TokenDType::I16:
      return fn(reinterpret_cast<const int16_t*>(data));
    case TokenDType::U16:
      return fn(reinterpret_cast<const uint16_t*>(data));
    case TokenDType::I32:
      return fn(reinterpret_cast<const int32_t*>(data));
    case TokenDType::U32:
      return fn(reinterpret_cast<const uint32_t*>(data));
    case TokenDType::I64:
      return fn(reinterpret_cast<const int64_t*>(data));
  }
  MOP_UNREACHABLE();
}

bool file_exists(const std::string& path) {
  std::error_code ec;
  return std::filesystem::exists(path, ec);
}
}  // namespace

TokenShard::TokenShard(MappedFile tokens, TokenDType dtype, int64_t eos_id,
                       std::optional<MegatronIndex> index)
    : tokens_(std::move(tokens)), dtype_(dtype), eos_id_(eos_id), index_(std::move(index)) {
  num_tokens_ = int64_t(tokens_.size() / token_dtype_size(dtype_));
}

TokenShard TokenShard::open_flat(const std::string& path, TokenDType dtype, int64_t eos_id) {
  MOP_CHECK(dtype == TokenDType::U16 || dtype == TokenDType::U32, "flat dtype ",
            token_dtype_name(dtype));
  MappedFile file(path, kTokenAdvice);
  size_t item = token_dtype_size(dtype);
  MOP_USER_CHECK(file.size() % item == 0, path, ": size ", file.size(),
                 " bytes is not a multiple of ", item, " (", token_dtype_name(dtype),
                 " tokens); is the flat dtype right?");
  return TokenShard(std::move(file), dtype, eos_id < 0 ? -1 : eos_id, std::nullopt);
}

TokenShard TokenShard::open_megatron(std::string_view path) {
  MegatronPaths p = megatron_paths(path);
  for (const std::string* f : {&p.idx, &p.bin})
    MOP_USER_CHECK(file_exists(*f), *f, ": no such file (a Megatron dataset needs ", p.bin, " and ",
                   p.idx, ")");
  MappedFile bin(p.bin, kTokenAdvice);
  MegatronIndex index(p.idx, bin.size(), p.bin);
  TokenDType dtype = index.dtype();
  // The index already checked that the .bin holds exactly its sequences (a whole number of tokens).
  return TokenShard(std::move(bin), dtype, -1, std::move(index));
}

void TokenShard::throw_out_of_vocab(int64_t position, int64_t token, int64_t vocab_size) const {
  throw_user_error(path(), ": token ", token, " at position ", position,
                   " is outside the vocabulary (vocab_size ", vocab_size, ")");
}

void TokenShard::read(int64_t first, int64_t count, uint32_t* out, int64_t vocab_size) const {
  MOP_CHECK(first >= 0 && count >= 0 && first + count <= num_tokens_, "read [", first, ", ",
            first + count, ") of ", num_tokens_, " tokens in ", path());
  MOP_CHECK(vocab_size > 0 && vocab_size <= kNoVocabLimit, "vocab_size ", vocab_size);
  if (count == 0) return;
  visit_tokens(tokens_.data(), dtype_, [&](const auto* src) {
    if (copy_widened(src + first, count, out, vocab_size)) [[unlikely]] {
      int64_t i = first_out_of_vocab(src + first, count, vocab_size);
      throw_out_of_vocab(first + i, int64_t(src[first + i]), vocab_size);
    }
  });
}

void TokenShard::validate_tokens(int64_t vocab_size) const {
  if (num_tokens_ == 0) return;
  int64_t bad = -1, token = 0;
  tokens_.advise(MapAdvice::Sequential);
  visit_tokens(tokens_.data(), dtype_, [&](const auto* src) {
    bad = first_out_of_vocab(src, num_tokens_, vocab_size);
    if (bad >= 0) token = int64_t(src[bad]);
  });
  tokens_.advise(kTokenAdvice);
  if (bad >= 0) throw_out_of_vocab(bad, token, vocab_size);
}

std::vector<int64_t> TokenShard::document_boundaries() const {
  std::vector<int64_t> starts;
  if (index_) {
    const int64_t item = int64_t(token_dtype_size(dtype_));
    starts.reserve(size_t(index_->num_sequences()) + 1);
    for (int64_t i = 0; i < index_->num_sequences(); ++i)
      starts.push_back(index_->sequence_pointer(i) / item);
  } else {
    if (num_tokens_ == 0) return {0};
    starts.push_back(0);
    if (eos_id_ >= 0 && num_tokens_ > 0) {
      visit_tokens(tokens_.data(), dtype_, [&](const auto* src) {
        for (int64_t i = 0; i + 1 < num_tokens_; ++i)
          if (int64_t(src[i]) == eos_id_) starts.push_back(i + 1);
      });
    }
  }
  starts.push_back(num_tokens_);
  return starts;
}

bool looks_like_megatron(std::string_view path) {
  if (file_exists(std::string(path) + ".idx")) return true;
  return (path.ends_with(".idx") || path.ends_with(".bin")) &&
         file_exists(megatron_paths(path).idx);
}

TokenShard open_token_shard(std::string_view path, std::string_view format, TokenDType flat_dtype,
                            int64_t eos_id) {
  if (format == "megatron") return TokenShard::open_megatron(path);
  if (format == "flat") return TokenShard::open_flat(std::string(path), flat_dtype, eos_id);
  MOP_USER_CHECK(format == "auto", "data format must be auto, megatron or flat (got \"", format,
                 "\")");
  if (looks_like_megatron(path)) return TokenShard::open_megatron(path);
  MOP_USER_CHECK(file_exists(std::string(path)), path,
                 ": no such file (expected a flat token file, or the prefix of a Megatron dataset "
                 "with ",
                 path, ".bin and ", path, ".idx)");
  return TokenShard::open_flat(std::string(path), flat_dtype, eos_id);
}

}  // namespace mop
