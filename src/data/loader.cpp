// TokenLoader: option checks, the window split, the per-epoch shuffle and window filling.
// A window is read straight into the caller's inputs row (int32 and uint32 may alias) plus one
// extra token, so filling allocates nothing.
#include "data/loader.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

#include <fmt/format.h>

#include "core/error.h"
#include "core/rng.h"

namespace mop {
namespace {
// Philox stream of epoch 0's shuffle; epoch e uses this + e. Distinct from the parameter streams,
// which are FNV hashes of tensor names.
uint64_t shuffle_stream() {
  static const uint64_t stream = fnv1a64("mop.data.window_shuffle");
  return stream;
}

// Uniform in [0, n) from 64 random bits (Lemire's multiply-high; the bias, n / 2^64, is far below
// anything a data order could show).
uint64_t uniform_below(uint64_t n, uint64_t bits) {
  return uint64_t((static_cast<unsigned __int128>(bits) * n) >> 64);
}

void check_options(const TokenLoaderOptions& o) {
  MOP_USER_CHECK(!o.paths.empty(), "no data paths given");
  MOP_USER_CHECK(o.vocab_size > 0 && o.vocab_size <= std::numeric_limits<int32_t>::max(),
                 "vocab_size must be in 1..2147483647 (got ", o.vocab_size, ")");
  MOP_USER_CHECK(o.seq_len >= 1, "seq_len must be at least 1 (got ", o.seq_len, ")");
  MOP_USER_CHECK(o.eos_id >= -1 && o.eos_id < o.vocab_size, "eos_id ", o.eos_id,
                 " is outside the vocabulary (vocab_size ", o.vocab_size, "; -1 means none)");
  MOP_USER_CHECK(o.eos_id >= 0 || !o.eod_mask_loss,
                 "eod_mask_loss needs eos_id (the token id that ends each document)");
  MOP_USER_CHECK(o.eos_id >= 0 || !o.reset_position_ids,
                 "reset_position_ids needs eos_id (the token id that ends each document)");
  MOP_USER_CHECK(std::isfinite(o.valid_fraction) && o.valid_fraction >= 0 && o.valid_fraction < 0.5,
                 "valid_fraction must be in [0, 0.5) (got ", o.valid_fraction, ")");
  (void)parse_flat_dtype(o.flat_dtype);
}
}  // namespace

std::vector<int64_t> shuffled_window_order(int64_t n, uint64_t seed, int64_t epoch) {
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), int64_t(0));
  const uint64_t stream = shuffle_stream() + uint64_t(epoch);
  for (int64_t i = n - 1; i > 0; --i) {
    int64_t j = int64_t(uniform_below(uint64_t(i) + 1, philox_u64(seed, stream, uint64_t(i))));
    std::swap(order[size_t(i)], order[size_t(j)]);
  }
  return order;
}

TokenLoader::TokenLoader(TokenLoaderOptions options) : options_(std::move(options)) {
  check_options(options_);
  const TokenDType flat_dtype = parse_flat_dtype(options_.flat_dtype);
  shard_begin_.push_back(0);
  for (const std::string& path : options_.paths) {
    shards_.push_back(open_token_shard(path, options_.format, flat_dtype, options_.eos_id));
    shard_begin_.push_back(shard_begin_.back() + shards_.back().num_tokens());
  }
  const int64_t n = num_tokens(), s = options_.seq_len;
  const int64_t total = n >= 1 ? (n - 1) / s : 0;
  num_valid_ = int64_t(std::floor(double(total) * options_.valid_fraction));
  if (options_.valid_fraction > 0) num_valid_ = std::min(std::max<int64_t>(num_valid_, 1), total);
  num_train_ = total - num_valid_;
  if (num_train_ < 1) {
    // One training window needs S+1 tokens; a split needs a second window (S more tokens).
    const int64_t needed = options_.valid_fraction > 0 ? 2 * s + 1 : s + 1;
    const std::string held_out =
        num_valid_ ? fmt::format(", {} held out for validation", num_valid_) : std::string();
    throw_user_error("the data is too small for seq_len ", s, ": ", n, " tokens in ",
                     shards_.size(), shards_.size() == 1 ? " file give " : " files give ", total,
                     " window(s) of seq_len+1 tokens", held_out,
                     ", leaving no training window (need at least ", needed, " tokens)");
  }
}

std::shared_ptr<const std::vector<int64_t>> TokenLoader::epoch_order(int64_t epoch) const {
  std::lock_guard<std::mutex> lock(cache_mutex_);
  CachedPermutation* lru = &cache_[0];
  for (CachedPermutation& slot : cache_) {
    if (slot.order && slot.epoch == epoch) {
      slot.last_use = ++cache_clock_;
      return slot.order;
    }
    if (slot.last_use < lru->last_use) lru = &slot;
  }
  // Built under the lock: threads that need the same epoch wait for it instead of duplicating it.
  lru->order = std::make_shared<const std::vector<int64_t>>(
      shuffled_window_order(num_train_, options_.seed, epoch));
  lru->epoch = epoch;
  lru->last_use = ++cache_clock_;
  return lru->order;
}

int64_t TokenLoader::train_window(int64_t sample) const {
  MOP_CHECK(sample >= 0, "sample ", sample);
  return (*epoch_order(sample / num_train_))[size_t(sample % num_train_)];
}

void TokenLoader::read_stream(int64_t first, int64_t count, uint32_t* out) const {
  MOP_CHECK(first >= 0 && first + count <= num_tokens(), "stream read [", first, ", ",
            first + count, ") of ", num_tokens());
  // The last shard starting at or before `first` (empty shards are stepped over below).
  auto after = std::upper_bound(shard_begin_.begin(), shard_begin_.end(), first);
  size_t k = size_t(after - shard_begin_.begin()) - 1;
  while (count > 0) {
    int64_t local = first - shard_begin_[k];
    int64_t n = std::min(count, shards_[k].num_tokens() - local);
    if (n > 0) shards_[k].read(local, n, out, options_.vocab_size);
    first += n, count -= n, out += n;
    ++k;
  }
}

int64_t TokenLoader::fill_window(int64_t window, int32_t* inputs, int32_t* targets,
                                 int32_t* positions) const {
  const int64_t s = options_.seq_len;
  // inputs[0:S] = stream[w·S, w·S + S); targets are the same tokens shifted by one, plus one more.
  read_stream(window * s, s, reinterpret_cast<uint32_t*>(inputs));
  uint32_t last = 0;
  read_stream(window * s + s, 1, &last);
  std::copy(inputs + 1, inputs + s, targets);
  targets[s - 1] = int32_t(last);

  const int32_t eos = int32_t(options_.eos_id);
  int64_t num_valid_targets = s;
  if (options_.eod_mask_loss) {
    for (int64_t i = 0; i < s; ++i) {
      if (inputs[i] == eos) {
        targets[i] = -1;
        --num_valid_targets;
      }
    }
  }
  if (positions) {
    int32_t p = 0;
    for (int64_t i = 0; i < s; ++i) {
      positions[i] = p;
      p = options_.reset_position_ids && inputs[i] == eos ? 0 : p + 1;
    }
  }
  return num_valid_targets;
}

int64_t TokenLoader::fill(int64_t first_sample, int num_samples, int32_t* inputs, int32_t* targets,
                          int32_t* positions) const {
  MOP_CHECK(first_sample >= 0 && num_samples >= 0, "fill(", first_sample, ", ", num_samples, ")");
  const int64_t s = options_.seq_len;
  int64_t total = 0, epoch = -1;
  std::shared_ptr<const std::vector<int64_t>> order;
  for (int i = 0; i < num_samples; ++i) {
    int64_t g = first_sample + i;
    if (g / num_train_ != epoch) {
      epoch = g / num_train_;
      order = epoch_order(epoch);
    }
    int64_t window = (*order)[size_t(g % num_train_)];
    total += fill_window(window, inputs + i * s, targets + i * s,
                         positions ? positions + i * s : nullptr);
  }
  return total;
}

int64_t TokenLoader::fill_valid(int64_t first_valid, int num_samples, int32_t* inputs,
                                int32_t* targets, int32_t* positions) const {
  MOP_CHECK(num_valid_ > 0, "fill_valid without validation windows (valid_fraction 0)");
  MOP_CHECK(first_valid >= 0 && num_samples >= 0, "fill_valid(", first_valid, ", ", num_samples,
            ")");
  const int64_t s = options_.seq_len;
  int64_t total = 0;
  for (int i = 0; i < num_samples; ++i) {
    int64_t window = num_train_ + (first_valid + i) % num_valid_;
    total += fill_window(window, inputs + i * s, targets + i * s,
                         positions ? positions + i * s : nullptr);
  }
  return total;
}

void TokenLoader::validate_all_tokens() const {
  for (const TokenShard& shard : shards_) shard.validate_tokens(options_.vocab_size);
}

uint64_t TokenLoader::fingerprint() const {
  std::string key =
      fmt::format("S={};seed={};train={};valid={};eos={};mask={};reset={};vocab={}",
                  options_.seq_len, options_.seed, num_train_, num_valid_, options_.eos_id,
                  options_.eod_mask_loss, options_.reset_position_ids, options_.vocab_size);
  for (const TokenShard& shard : shards_)
    key += fmt::format(";{}:{}", token_dtype_name(shard.dtype()), shard.num_tokens());
  return fnv1a64(key);
}

std::string TokenLoader::summary() const {
  return fmt::format("{} file{}, {} tokens: {} training + {} validation windows of {}+1",
                     shards_.size(), shards_.size() == 1 ? "" : "s", num_tokens(), num_train_,
                     num_valid_, options_.seq_len);
}

}  // namespace mop
