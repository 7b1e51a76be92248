// prepare_data: maps each input file, splits it into documents and streams the bytes (widened to
// token ids) plus an EOS per document through IndexedDatasetWriter.
#include "data/prepare_data.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <exception>
#include <cstring>
#include <filesystem>
#include <vector>

#include "core/error.h"
#include "data/indexed_dataset_writer.h"
#include "core/mapped_file.h"
#include "core/rng.h"
#include "data/megatron_format.h"
#include "data/tokenizer.h"
#include "data/tokenizer_files.h"
#include "ckpt/json.h"

namespace mop {
namespace {
bool is_blank_byte(uint8_t c) {
  return c == ' ' || c == '\t' || c == '\r' || c == '\f' || c == '\v';
}

// Calls emit(begin, end) for each block of non-blank lines; `end` excludes the block's final line
// break ("\n" or "\r\n").
template <class Emit>
void for_each_block(const uint8_t* data, size_t size, Emit&& emit) {
  size_t pos = 0, block_begin = size, block_end = 0;
  bool in_block = false;
  while (pos < size) {
    const void* nl = std::memchr(data + pos, '\n', size - pos);
    size_t line_end = nl ? size_t(static_cast<const uint8_t*>(nl) - data) : size;
    size_t content_end = line_end;
    if (content_end > pos && data[content_end - 1] == '\r') --content_end;
    bool blank = true;
    for (size_t i = pos; i < line_end && blank; ++i) blank = is_blank_byte(data[i]);
    if (blank && in_block) {
      emit(block_begin, block_end);
      in_block = false;
    } else if (!blank) {
      if (!in_block) block_begin = pos;
      in_block = true;
      block_end = content_end;
    }
    pos = nl ? line_end + 1 : size;
  }
  if (in_block) emit(block_begin, block_end);
}

// Writes bytes [begin, end) as tokens, then the EOS, as one document.
void write_document(IndexedDatasetWriter& writer, const uint8_t* data, size_t begin, size_t end,
                    std::vector<uint32_t>& buffer) {
  for (size_t pos = begin; pos < end;) {
    size_t n = std::min(buffer.size(), end - pos);
    for (size_t i = 0; i < n; ++i) buffer[i] = data[pos + i];
    writer.add_tokens({buffer.data(), n});
    pos += n;
  }
  const uint32_t eos = kByteEosId;
  writer.add_tokens({&eos, 1});
  writer.end_document();
}
}  // namespace

DocSplit parse_doc_split(std::string_view name) {
  if (name == "file") return DocSplit::File;
  if (name == "blank-line") return DocSplit::BlankLine;
  throw_user_error("document split must be file or blank-line (got \"", name, "\")");
}

namespace {

// Calls emit(text, where) for every document of `file`: the whole file, its blank-line blocks, or
// with a JSON key each line's string.
template <class Emit>
void for_each_document(const MappedFile& file, const PrepareDataOptions& o, Emit&& emit) {
  const char* data = reinterpret_cast<const char*>(file.data());
  if (!o.json_key.empty()) {
    size_t pos = 0;
    for (int64_t line_no = 1; pos < file.size(); ++line_no) {
      const void* nl = std::memchr(data + pos, '\n', file.size() - pos);
      const size_t end = nl ? size_t(static_cast<const char*>(nl) - data) : file.size();
      std::string_view line(data + pos, end - pos);
      pos = end + 1;
      if (line.find_first_not_of(" \t\r") == std::string_view::npos) continue;
      const std::string where = file.path() + ":" + std::to_string(line_no);
      const Json j = parse_json(line, where);
      const Json* v = j.is_object() ? j.find(o.json_key) : nullptr;
      MOP_USER_CHECK(v && v->is_string(), where, ": no string \"", o.json_key, "\" (--json-key)");
      emit(v->as_string(where), where);
    }
    return;
  }
  if (o.split == DocSplit::File) {
    emit(std::string(data, file.size()), file.path());
    return;
  }
  for_each_block(file.data(), file.size(), [&](size_t begin, size_t end) {
    emit(std::string(data + begin, end - begin), file.path());
  });
}

// Finishes the files (and removes a tokenizer an earlier run left beside them); the stats of what
// they hold.
PrepareDataStats finish(IndexedDatasetWriter& writer, const MegatronPaths& out, PrepareDataStats stats) {
  writer.finish();
  TokenizerFiles::remove_beside_data(out.prefix);
  stats.num_documents = writer.num_documents();
  stats.num_tokens = writer.num_tokens();
  stats.num_output_bytes = writer.num_bytes_written();
  stats.bin_path = out.bin;
  stats.idx_path = out.idx;
  return stats;
}

int32_t resolve_eos(const Tokenizer& tok, const PrepareDataOptions& o) {
  if (!o.eos_token.empty()) {
    const auto id = tok.token_id(o.eos_token);
    MOP_USER_CHECK(id.has_value(), "--eos-token ", o.eos_token, ": not a token of ", o.tokenizer);
    return *id;
  }
  for (const char* name : {"<|endoftext|>", "<|end_of_text|>", "<|im_end|>", "</s>"})
    if (const auto id = tok.token_id(name)) return *id;
  throw_user_error(o.tokenizer, ": no end-of-document token found (<|endoftext|>, <|end_of_text|>, "
                   "<|im_end|>, </s>); name it with --eos-token");
}

// Documents encoded with a tokenizer, a batch at a time on every core, written in order.
PrepareDataStats prepare_tokenized(const PrepareDataOptions& o, const std::vector<MappedFile>& files,
                                   const MegatronPaths& out) {
  const Tokenizer tok = Tokenizer::load(o.tokenizer);
  const int32_t eos = resolve_eos(tok, o);
  PrepareDataStats stats;
  stats.vocab_size = tok.vocab_size();
  stats.eos_id = eos;
  IndexedDatasetWriter writer(out.prefix, megatron_dtype_for_vocab(tok.vocab_size()));
  int64_t total_bytes = 0, done_bytes = 0;
  for (const MappedFile& f : files) total_bytes += int64_t(f.size());
  const auto start = std::chrono::steady_clock::now();
  auto last_report = start;
  std::vector<std::string> batch, where;
  size_t batch_bytes = 0;
  auto flush = [&] {
    std::vector<std::vector<int32_t>> ids(batch.size());
    std::vector<std::exception_ptr> errors(batch.size());
#pragma omp parallel for schedule(dynamic, 1)
    for (int64_t i = 0; i < int64_t(batch.size()); ++i) {
      try {
        ids[size_t(i)] = tok.encode(batch[size_t(i)], /*add_special_tokens=*/true);
      } catch (...) {
        errors[size_t(i)] = std::current_exception();
      }
    }
    std::vector<uint32_t> doc;
    for (size_t i = 0; i < batch.size(); ++i) {
      if (errors[i]) {
        try {
          std::rethrow_exception(errors[i]);
        } catch (const UserError& e) {
          throw_user_error(where[i], ": ", e.what());
        }
      }
      doc.assign(ids[i].begin(), ids[i].end());
      doc.push_back(uint32_t(eos));
      writer.add_document(doc);
      done_bytes += int64_t(batch[i].size());
    }
    batch.clear(), where.clear(), batch_bytes = 0;
    const auto now = std::chrono::steady_clock::now();
    if (o.progress && now - last_report > std::chrono::seconds(2)) {
      last_report = now;
      const double s = std::chrono::duration<double>(now - start).count();
      const double rate = double(done_bytes) / std::max(s, 1e-9);
      std::fprintf(stderr, "prepare-data: %.1f of %.1f MB (%.1f MB/s), %lld documents, %lld tokens, ETA %.0f s\n",
                   double(done_bytes) / 1e6, double(total_bytes) / 1e6, rate / 1e6,
                   (long long)writer.num_documents(), (long long)writer.num_tokens(),
                   double(total_bytes - done_bytes) / std::max(rate, 1.0));
    }
  };
  for (const MappedFile& file : files) {
    stats.num_input_bytes += int64_t(file.size());
    const int64_t documents_before = writer.num_documents() + int64_t(batch.size());
    for_each_document(file, o, [&](std::string text, const std::string& at) {
      batch_bytes += text.size();
      batch.push_back(std::move(text));
      where.push_back(at);
      if (batch_bytes >= (16u << 20) || batch.size() >= 4096) flush();
    });
    MOP_USER_CHECK(writer.num_documents() + int64_t(batch.size()) > documents_before, file.path(),
                   ": no documents");
  }
  flush();
  PrepareDataStats done = finish(writer, out, stats);
  // The tokenizer goes with the shards: training copies it into the checkpoints.
  TokenizerFiles::read(o.tokenizer, "--tokenizer").write_beside_data(out.prefix);
  return done;
}

}  // namespace

PrepareDataStats prepare_data(const PrepareDataOptions& options) {
  MOP_USER_CHECK(!options.inputs.empty(), "prepare-data needs at least one input file");
  MOP_USER_CHECK(!options.output.empty(), "prepare-data needs an output prefix");
  // Map every input first, so a bad path fails before anything is written.
  std::vector<MappedFile> files;
  for (const std::string& path : options.inputs) {
    files.emplace_back(path, MapAdvice::Sequential);
    MOP_USER_CHECK(files.back().size() > 0, path, ": is empty");
  }
  MegatronPaths out = megatron_paths(options.output);
  std::filesystem::path parent = std::filesystem::path(out.bin).parent_path();
  if (!parent.empty()) {
    std::error_code ec;
    std::filesystem::create_directories(parent, ec);
    MOP_USER_CHECK(!ec, "cannot create directory ", parent.string(), ": ", ec.message());
  }

  if (!options.tokenizer.empty()) return prepare_tokenized(options, files, out);
  MOP_USER_CHECK(options.json_key.empty(), "--json-key needs --tokenizer (byte-level shards are "
                 "made from text files)");
  PrepareDataStats stats;
  IndexedDatasetWriter writer(out.prefix, TokenDType::U16);
  std::vector<uint32_t> buffer(1 << 16);
  for (const MappedFile& file : files) {
    stats.num_input_bytes += int64_t(file.size());
    if (options.split == DocSplit::File) {
      write_document(writer, file.data(), 0, file.size(), buffer);
      continue;
    }
    int64_t documents_before = writer.num_documents();
    for_each_block(file.data(), file.size(), [&](size_t begin, size_t end) {
      write_document(writer, file.data(), begin, end, buffer);
    });
    MOP_USER_CHECK(writer.num_documents() > documents_before, file.path(),
                   ": no documents (only blank lines)");
  }
  return finish(writer, out, stats);
}

PrepareDataStats prepare_random_tokens(const RandomTokensOptions& o) {
  MOP_USER_CHECK(o.num_tokens >= 1, "--random-tokens ", o.num_tokens, ": must be at least 1");
  MOP_USER_CHECK(o.vocab_size >= 2 && o.vocab_size <= INT32_MAX, "--vocab-size ", o.vocab_size,
                 ": must be in [2, 2147483647]");
  MOP_USER_CHECK(o.document_tokens >= 1 && o.document_tokens <= INT32_MAX, "--document-tokens ",
                 o.document_tokens, ": must be in [1, 2147483647]");
  MOP_USER_CHECK(!o.output.empty(), "--output: an output prefix is required");
  const std::filesystem::path parent = std::filesystem::path(o.output).parent_path();
  if (!parent.empty()) std::filesystem::create_directories(parent);
  IndexedDatasetWriter w(o.output, megatron_dtype_for_vocab(o.vocab_size));
  std::vector<uint32_t> buf;
  const int64_t kBlock = 1 << 16;
  const uint64_t v = uint64_t(o.vocab_size);
  for (int64_t doc = 0; doc * o.document_tokens < o.num_tokens; ++doc) {
    const int64_t begin = doc * o.document_tokens;
    const int64_t end = std::min(o.num_tokens, begin + o.document_tokens);
    for (int64_t i = begin; i < end; i += kBlock) {
      const int64_t n = std::min(kBlock, end - i);
      buf.resize(size_t(n));
      // A 64-bit draw modulo V: the bias (V / 2^64) is far below anything a benchmark can see.
      for (int64_t j = 0; j < n; ++j) buf[size_t(j)] = uint32_t(philox_u64(o.seed, 0x72616e64, uint64_t(i + j)) % v);
      w.add_tokens(buf);
    }
    w.end_document();
  }
  PrepareDataStats st;
  st.vocab_size = o.vocab_size;
  st.eos_id = -1;
  return finish(w, w.paths(), st);
}

}  // namespace mop
