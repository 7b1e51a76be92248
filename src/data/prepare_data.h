// prepare_data (`mop prepare-data`): text files → a byte-level Megatron dataset (uint16). Token id
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
};

struct PrepareDataStats {
  int64_t num_documents = 0;
  int64_t num_tokens = 0;        // text bytes + one EOS per document
  int64_t num_input_bytes = 0;   // total size of the input files
  int64_t num_output_bytes = 0;  // .bin + .idx
  std::string bin_path, idx_path;
};

PrepareDataStats prepare_data(const PrepareDataOptions& options);

}  // namespace mop
