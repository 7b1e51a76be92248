// prepare_data (`mop prepare-data`): text files → a byte-level Megatron dataset (uint16); or
// uniformly random token ids over any vocabulary (prepare_random_tokens) for benchmarks. Token id
// = byte value 0..255; kByteEosId = 256 ends every document, so the vocabulary is 257 ids and a
// model trained on it needs vocab_size ≥ 257 and eos_id 256.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace mop {

inline constexpr int kByteVocabSize = 257;
inline constexpr int kByteEosId = 256;

// File: each input file is one document, byte for byte.
// BlankLine: runs of non-blank lines are documents; one or more blank lines (empty or only
// spaces, tabs, CR) separate them. A document keeps its inner line breaks but not the one after
// its last line. Documents never span files.
enum class DocSplit { File, BlankLine };
// "file" | "blank-line"; anything else is a UserError.
DocSplit parse_doc_split(std::string_view name);

struct PrepareDataOptions {
  std::vector<std::string> inputs;  // text files; each must exist, be readable and not be empty
  std::string output;               // prefix (or .bin/.idx name); parent directories are created
  DocSplit split = DocSplit::File;
  // A Hugging Face tokenizer.json (data/tokenizer.h): its ids instead of bytes — each document
  // encoded with the tokenizer's post-processor tokens (the BOS of a Llama template), as
  // Megatron's preprocess_data.py does with a Hugging Face tokenizer — then its EOS (eos_token, or
  // the first of <|endoftext|>, <|end_of_text|>, <|im_end|>, </s> it has); the smallest Megatron
  // dtype that holds its vocabulary; documents encoded in parallel. The tokenizer.json (and its
  // companions) is copied beside the shards as <prefix>.tokenizer.json for training to carry.
  std::string tokenizer;
  std::string eos_token;
  // JSON lines: each line is an object and its `json_key` string is one document (split ignored).
  std::string json_key;
  bool progress = false;  // a progress line on stderr (bytes/s, documents, tokens, ETA)
};

struct PrepareDataStats {
  int64_t vocab_size = kByteVocabSize;  // of the ids written
  int64_t eos_id = kByteEosId;
  int64_t num_documents = 0;
  int64_t num_tokens = 0;        // text bytes + one EOS per document
  int64_t num_input_bytes = 0;   // total size of the input files
  int64_t num_output_bytes = 0;  // .bin + .idx
  std::string bin_path, idx_path;
};

PrepareDataStats prepare_data(const PrepareDataOptions& options);

// `mop prepare-data --random-tokens N --vocab-size V`: N token ids drawn uniformly from [0, V)
// (counter-based, so the same seed writes the same file), in documents of document_tokens (the
// last one shorter), no EOS, the smallest Megatron dtype that holds V. What throughput benchmarks
// train on: a router trained or not spreads such tokens evenly over the experts, as a trained
// router spreads real text (a byte-level corpus uses 257 ids and skews the routing). Train on it
// with data.eos_id: -1, since every id, EOS included, occurs at random.
struct RandomTokensOptions {
  std::string output;
  int64_t num_tokens = 0;          // ≥ 1
  int64_t vocab_size = 0;          // 2 .. 2^31 - 1
  int64_t document_tokens = 1 << 20;
  uint64_t seed = 0;
};
PrepareDataStats prepare_random_tokens(const RandomTokensOptions& options);

}  // namespace mop
