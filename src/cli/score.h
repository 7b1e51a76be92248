// `mop score`: the mean next-token cross-entropy of token sequences under a checkpoint, and
// optionally every position's logits, on the CPU (fp32) or the GPU (bf16): the numbers to compare
// with another implementation of the same model (scripts/hf_parity.py compares them with
// transformers). Built on Transformer::forward and Transformer::logits.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace mop {

// Token sequences from a file. Text (every byte a digit, '-' or whitespace): whitespace-separated
// ids, one sequence per non-empty line. Otherwise binary: little-endian int32 ids, split into
// sequences of seq_len (0: the whole file is one sequence). Empty files are a UserError.
std::vector<std::vector<int32_t>> read_token_file(const std::string& path, int64_t seq_len);

struct ScoreResult {
  int64_t tokens = 0;     // all positions
  int64_t predicted = 0;  // targets: every position but each sequence's last
  double ce_sum = 0;      // Σ cross-entropy (nats) over the targets
  int64_t vocab = 0;
  std::vector<float> logits;  // [tokens, vocab], sequences in order; filled when asked for
  double mean_ce() const { return predicted ? ce_sum / double(predicted) : 0.0; }
};

// Scores each sequence as one forward pass (position i predicts token i + 1). `checkpoint`: a
// step_N directory or a checkpoint.dir (its latest); device "cpu" (fp32) or "cuda" (bf16).
ScoreResult score_sequences(const std::string& checkpoint,
                            const std::vector<std::vector<int32_t>>& seqs,
                            const std::string& device, bool want_logits);

// Text sequences, one per non-empty line of `path`, encoded as the checkpoint `checkpoint` (a step_N
// directory or a checkpoint.dir) reads text: with its tokenizer (cli/text_codec.h).
std::vector<std::vector<int32_t>> read_text_file(const std::string& path, const std::string& checkpoint);

struct ScoreArgs {
  std::string checkpoint, tokens, text, device = "cpu", out;
  int64_t seq_len = 0;
};
int cmd_score(const ScoreArgs& args);

}  // namespace mop
