// TokenLoader: deterministic packed-sequence samples over one or more token shards. The shards are
// concatenated into one stream; training samples are shuffled windows of seq_len+1 tokens, and
// sample g is a pure function of (seed, g), so the loader's whole state is the number of samples
// consumed (the "cursor" the trainer checkpoints). The tail of the stream is a validation split.
#pragma once

#include <array>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "data/token_shard.h"

namespace mop {

struct TokenLoaderOptions {
  std::vector<std::string> paths;     // each a Megatron prefix/.bin/.idx or a flat token file
  std::string format = "auto";        // auto | megatron | flat (auto: megatron when an .idx exists)
  std::string flat_dtype = "uint16";  // uint16 | uint32, for flat files
  int64_t eos_id = -1;                // id that ends each document; -1: none
  int64_t vocab_size = 0;             // every token must be in [0, vocab_size)
  int seq_len = 0;                    // S: tokens per sample
  uint64_t seed = 0;                  // shuffling key
  bool eod_mask_loss = false;         // mask targets whose input token is eos_id
  bool reset_position_ids = false;    // positions restart at 0 after each eos_id in the input
  double valid_fraction = 0.0;        // in [0, 0.5): trailing windows held out for validation
};

// Window w covers stream tokens [w·S, w·S + S + 1): inputs = window[0:S], targets = window[1:S+1].
// Windows 0..num_train_windows()-1 are training windows; the rest (the last valid_fraction of
// them, at least one when valid_fraction > 0) are validation windows. Training targets never
// reach past token num_train·S, so no validation target is ever a training token.
//
// Epoch e = g / num_train_windows() visits the training windows in a Philox Fisher–Yates order
// keyed by (seed, e); sample g is position g % num_train_windows() of that order.
//
// fill/fill_valid are const and safe to call from several threads at once: the only shared state
// is a small mutex-guarded cache of the two most recently used epoch permutations. The loader is
// neither copyable nor movable (hold it by unique_ptr when needed).
class TokenLoader {
 public:
  // Opens and validates every shard and the options (UserError on bad input, including data too
  // small for one training window). Tokens are checked against vocab_size as windows are read.
  explicit TokenLoader(TokenLoaderOptions options);
  TokenLoader(const TokenLoader&) = delete;
  TokenLoader& operator=(const TokenLoader&) = delete;

  const TokenLoaderOptions& options() const { return options_; }
  int seq_len() const { return options_.seq_len; }
  int64_t num_tokens() const { return shard_begin_.back(); }
  int64_t num_windows() const { return num_train_ + num_valid_; }
  int64_t num_train_windows() const { return num_train_; }
  int64_t num_valid_windows() const { return num_valid_; }
  const std::vector<TokenShard>& shards() const { return shards_; }

  // The window that global training sample `sample` (≥ 0) reads.
  int64_t train_window(int64_t sample) const;

  // Writes samples first_sample .. first_sample+num_samples-1, each seq_len entries:
  //   inputs    (num_samples, S)  token ids
  //   targets   (num_samples, S)  next token ids, -1 where masked (eod_mask_loss)
  //   positions (num_samples, S)  0..S-1, or restarting after each EOS; may be null
  // Returns the number of unmasked targets (the loss denominator).
  int64_t fill(int64_t first_sample, int num_samples, int32_t* inputs, int32_t* targets,
               int32_t* positions) const;
  // Same for validation windows, in stream order: index v reads validation window
  // v % num_valid_windows(). Needs num_valid_windows() > 0.
  int64_t fill_valid(int64_t first_valid, int num_samples, int32_t* inputs, int32_t* targets,
                     int32_t* positions) const;

  // Checks every token of every shard against vocab_size (a full scan, for `mop validate`).
  void validate_all_tokens() const;

  // Hash of everything that decides which tokens sample g holds (token counts and dtypes of the
  // shards, S, seed, split, masking). The trainer stores it with the cursor: a resume whose
  // fingerprint differs would continue on a different sample order.
  uint64_t fingerprint() const;
  // One line for the log: "2 files, 1234567 tokens: 300 training + 3 validation windows of 4096+1".
  std::string summary() const;

 private:
  struct CachedPermutation {
    int64_t epoch = -1;
    uint64_t last_use = 0;
    std::shared_ptr<const std::vector<int64_t>> order;
  };

  std::shared_ptr<const std::vector<int64_t>> epoch_order(int64_t epoch) const;
  void read_stream(int64_t first, int64_t count, uint32_t* out) const;
  int64_t fill_window(int64_t window, int32_t* inputs, int32_t* targets, int32_t* positions) const;

  TokenLoaderOptions options_;
  std::vector<TokenShard> shards_;
  std::vector<int64_t> shard_begin_;  // stream offset of each shard, then the total
  int64_t num_train_ = 0, num_valid_ = 0;

  mutable std::mutex cache_mutex_;
  mutable std::array<CachedPermutation, 2> cache_;
  mutable uint64_t cache_clock_ = 0;
};

// Epoch `epoch`'s order of n training windows under `seed`: a Fisher–Yates shuffle whose draws
// come from Philox at (seed, shuffle stream + epoch, i). Exposed for tests and tools.
std::vector<int64_t> shuffled_window_order(int64_t n, uint64_t seed, int64_t epoch);

}  // namespace mop
