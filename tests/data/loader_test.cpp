// TokenLoader: windows, the per-epoch shuffle, determinism under any batching or threading, the
// validation split, EOS masking and position resets, and the errors for bad options and data.
// Most tests use an "identity stream" (token at stream position p is p), so a sample's first
// input token names its window: window = inputs[0] / S.
#include <algorithm>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "catch.h"
#include "data/indexed_dataset_writer.h"
#include "data/loader.h"
#include "data_test_util.h"
#include "test_util.h"

using namespace mop;
using test::TempDir;

namespace {
// Flat uint32 file with tokens first..first+n-1.
std::string write_identity(const TempDir& dir, const std::string& name, int64_t n,
                           int64_t first = 0) {
  std::vector<int64_t> tokens(static_cast<size_t>(n));
  std::iota(tokens.begin(), tokens.end(), first);
  test::write_file(dir / name, test::token_bytes(tokens, 4));
  return dir / name;
}

TokenLoaderOptions identity_options(const TempDir& dir, int64_t n, int seq_len, uint64_t seed) {
  TokenLoaderOptions o;
  o.paths = {write_identity(dir, "identity.u32", n)};
  o.format = "flat";
  o.flat_dtype = "uint32";
  o.vocab_size = n;
  o.seq_len = seq_len;
  o.seed = seed;
  return o;
}

struct Batch {
  std::vector<int32_t> inputs, targets, positions;
  int64_t num_valid_targets = 0;
  Batch(int num_samples, int seq_len)
      : inputs(size_t(num_samples) * seq_len, -7),
        targets(size_t(num_samples) * seq_len, -7),
        positions(size_t(num_samples) * seq_len, -7) {}
  bool operator==(const Batch&) const = default;
};

Batch fill(const TokenLoader& loader, int64_t first, int num_samples) {
  Batch b(num_samples, loader.seq_len());
  b.num_valid_targets =
      loader.fill(first, num_samples, b.inputs.data(), b.targets.data(), b.positions.data());
  return b;
}

Batch fill_valid(const TokenLoader& loader, int64_t first, int num_samples) {
  Batch b(num_samples, loader.seq_len());
  b.num_valid_targets =
      loader.fill_valid(first, num_samples, b.inputs.data(), b.targets.data(), b.positions.data());
  return b;
}

// Windows read by samples first..first+n-1 of an identity stream.
std::vector<int64_t> windows_of(const TokenLoader& loader, int64_t first, int n) {
  Batch b = fill(loader, first, n);
  std::vector<int64_t> w;
  for (int i = 0; i < n; ++i)
    w.push_back(b.inputs[size_t(i) * loader.seq_len()] / loader.seq_len());
  return w;
}
}  // namespace

TEST_CASE("loader: window count, window contents and the validation split", "[cpu][data]") {
  TempDir dir;
  const int s = 4;
  TokenLoaderOptions o = identity_options(dir, 1 + 10 * s + 3, s, 1);  // 10 windows, 3 spare
  TokenLoader loader(o);
  CHECK(loader.num_tokens() == 44);
  CHECK(loader.num_windows() == 10);
  CHECK(loader.num_train_windows() == 10);
  CHECK(loader.num_valid_windows() == 0);

  // Every sample is a window: inputs w·S.., targets one later, positions 0..S-1, nothing masked.
  Batch b = fill(loader, 0, 10);
  CHECK(b.num_valid_targets == 10 * s);
  for (int i = 0; i < 10; ++i) {
    int64_t w = loader.train_window(i);
    for (int j = 0; j < s; ++j) {
      CHECK(b.inputs[size_t(i * s + j)] == w * s + j);
      CHECK(b.targets[size_t(i * s + j)] == w * s + j + 1);
      CHECK(b.positions[size_t(i * s + j)] == j);
    }
  }

  o.valid_fraction = 0.25;
  TokenLoader split(o);
  CHECK(split.num_train_windows() == 8);
  CHECK(split.num_valid_windows() == 2);
  std::vector<int64_t> train_order = windows_of(split, 0, 8);
  std::set<int64_t> train(train_order.begin(), train_order.end());
  CHECK(train == std::set<int64_t>{0, 1, 2, 3, 4, 5, 6, 7});
  // Validation windows come in stream order and wrap around.
  Batch v = fill_valid(split, 0, 5);
  for (int i = 0; i < 5; ++i) CHECK(v.inputs[size_t(i * s)] == (8 + i % 2) * s);
  // No validation target is a token any training window reads.
  int64_t max_train_token = 8 * s;
  for (int32_t t : v.targets) CHECK(t > max_train_token);
  for (int32_t t : fill(split, 0, 40).targets) CHECK(t <= max_train_token);

  o.valid_fraction = 0.01;  // rounds down to 0 windows, but a requested split gets at least one
  CHECK(TokenLoader(o).num_valid_windows() == 1);
}

TEST_CASE("loader: sample g depends only on (seed, g)", "[cpu][data]") {
  TempDir dir;
  const int s = 3, w = 17, n = 5 * w;
  TokenLoaderOptions o = identity_options(dir, 1 + w * s, s, 1234);
  TokenLoader a(o), b(o);
  Batch all = fill(a, 0, n);

  // Other batchings and call orders (crossing epoch boundaries) on another instance.
  Batch pieces(n, s);
  std::vector<int> sizes = {1, 7, 3, 16, 2, 11};
  std::vector<std::pair<int, int>> chunks;
  for (int first = 0, k = 0; first < n; first += sizes[k % sizes.size()], ++k)
    chunks.push_back({first, std::min<int>(sizes[k % sizes.size()], n - first)});
  std::reverse(chunks.begin(), chunks.end());
  std::swap(chunks[1], chunks[chunks.size() - 2]);
  for (auto [first, count] : chunks) {
    Batch c = fill(b, first, count);
    std::copy(c.inputs.begin(), c.inputs.end(), pieces.inputs.begin() + first * s);
    std::copy(c.targets.begin(), c.targets.end(), pieces.targets.begin() + first * s);
    std::copy(c.positions.begin(), c.positions.end(), pieces.positions.begin() + first * s);
    pieces.num_valid_targets += c.num_valid_targets;
  }
  CHECK(pieces == all);

  o.seed = 1235;
  TokenLoader other(o);
  CHECK(windows_of(other, 0, w) != windows_of(a, 0, w));
  CHECK(other.fingerprint() != a.fingerprint());
  CHECK(b.fingerprint() == a.fingerprint());
  CHECK(a.summary() == "1 file, 52 tokens: 17 training + 0 validation windows of 3+1");
}

TEST_CASE("loader: each epoch visits every training window exactly once", "[cpu][data]") {
  TempDir dir;
  const int s = 2, w = 23;
  TokenLoaderOptions o = identity_options(dir, 1 + w * s + 1, s, 99);
  o.valid_fraction = 0.1;  // 2 validation windows stay out of every epoch
  TokenLoader loader(o);
  const int64_t nt = loader.num_train_windows();
  REQUIRE(nt == 21);
  std::vector<int64_t> expected(static_cast<size_t>(nt));
  std::iota(expected.begin(), expected.end(), 0);
  std::vector<std::vector<int64_t>> orders;
  for (int64_t e = 0; e < 4; ++e) {
    std::vector<int64_t> order = windows_of(loader, e * nt, int(nt));
    CHECK(order == shuffled_window_order(nt, 99, e));
    for (int64_t i = 0; i < nt; ++i) CHECK(loader.train_window(e * nt + i) == order[size_t(i)]);
    std::vector<int64_t> sorted = order;
    std::sort(sorted.begin(), sorted.end());
    CHECK(sorted == expected);
    orders.push_back(order);
  }
  CHECK(orders[0] != orders[1]);
  CHECK(orders[1] != orders[2]);
  CHECK(orders[0] != expected);  // shuffled, not the stream order
}

TEST_CASE("loader: the shuffle draws every permutation equally often", "[cpu][data]") {
  // 24 permutations of 4 windows over 24000 seeds: ~1000 each, σ ≈ 31; ±200 is > 6σ. An
  // off-by-one in the draw (Sattolo's algorithm) would give only the 6 cyclic orders.
  std::map<std::vector<int64_t>, int> counts;
  for (uint64_t seed = 0; seed < 24000; ++seed) ++counts[shuffled_window_order(4, seed, 3)];
  CHECK(counts.size() == 24);
  for (const auto& [order, count] : counts) {
    INFO("count " << count);
    CHECK(std::abs(count - 1000) < 200);
  }
}

TEST_CASE("loader: eod_mask_loss and reset_position_ids", "[cpu][data]") {
  TempDir dir;
  test::write_file(dir / "docs.u16", test::token_bytes({5, 6, 0, 7, 8, 9, 0, 0, 3}, 2));
  TokenLoaderOptions o;
  o.paths = {dir / "docs.u16"};
  o.vocab_size = 10;
  o.eos_id = 0;
  o.seq_len = 8;
  TokenLoader plain(o);
  Batch b = fill(plain, 0, 1);
  CHECK(b.inputs == std::vector<int32_t>{5, 6, 0, 7, 8, 9, 0, 0});
  CHECK(b.targets == std::vector<int32_t>{6, 0, 7, 8, 9, 0, 0, 3});
  CHECK(b.positions == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(b.num_valid_targets == 8);

  o.eod_mask_loss = true;
  b = fill(TokenLoader(o), 0, 1);
  // Targets whose input is the EOS (predicting the next document's first token) are masked.
  CHECK(b.targets == std::vector<int32_t>{6, 0, -1, 8, 9, 0, -1, -1});
  CHECK(b.positions == std::vector<int32_t>{0, 1, 2, 3, 4, 5, 6, 7});
  CHECK(b.num_valid_targets == 5);

  o.reset_position_ids = true;
  b = fill(TokenLoader(o), 0, 1);
  CHECK(b.positions == std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0});
  CHECK(b.num_valid_targets == 5);

  o.eod_mask_loss = false;
  TokenLoader reset_only(o);
  b = fill(reset_only, 0, 1);
  CHECK(b.targets == std::vector<int32_t>{6, 0, 7, 8, 9, 0, 0, 3});
  CHECK(b.positions == std::vector<int32_t>{0, 1, 2, 0, 1, 2, 3, 0});
  // Positions may be left out.
  std::vector<int32_t> in(8), tg(8);
  CHECK(reset_only.fill(0, 1, in.data(), tg.data(), nullptr) == 8);
  CHECK(tg == b.targets);
}

TEST_CASE("loader: shards of both formats concatenate into one stream", "[cpu][data]") {
  TempDir dir;
  // Stream 0..12: a flat file of 0..6, then a Megatron dataset of 7..12 in two documents;
  // window 1 ([4, 9)) crosses from one shard to the next.
  write_identity(dir, "head.u32", 7);
  {
    IndexedDatasetWriter writer(dir / "tail", TokenDType::U16);
    writer.add_document(std::vector<uint32_t>{7, 8, 9});
    writer.add_document(std::vector<uint32_t>{10, 11, 12});
    writer.finish();
  }
  TokenLoaderOptions o;
  test::write_file(dir / "empty.u32", {});  // an empty shard between them changes nothing
  o.paths = {dir / "head.u32", dir / "empty.u32", dir / "tail"};
  o.flat_dtype = "uint32";
  o.vocab_size = 13;
  o.seq_len = 4;
  TokenLoader loader(o);
  CHECK(loader.shards()[2].is_megatron());
  CHECK(loader.num_tokens() == 13);
  CHECK(loader.num_train_windows() == 3);
  Batch b = fill(loader, 0, 3);
  for (int i = 0; i < 3; ++i) {
    int64_t w = loader.train_window(i);
    for (int j = 0; j < 4; ++j) {
      CHECK(b.inputs[size_t(i * 4 + j)] == w * 4 + j);
      CHECK(b.targets[size_t(i * 4 + j)] == w * 4 + j + 1);
    }
  }
}

TEST_CASE("loader: concurrent fills equal serial ones", "[cpu][data]") {
  TempDir dir;
  const int s = 5, w = 40, n = 6 * w;
  TokenLoaderOptions o = identity_options(dir, 1 + w * s, s, 7);
  TokenLoader serial(o), shared(o);
  Batch expected = fill(serial, 0, n);
  std::vector<Batch> got(8, Batch(n, s));
  std::vector<std::thread> threads;
  for (int t = 0; t < 8; ++t) {
    threads.emplace_back([&, t] {
      // Each thread walks the samples in its own order, so the threads hit different epochs.
      for (int k = 0; k < n; ++k) {
        int g = int((uint64_t(k) * 37 + uint64_t(t) * 101) % n);
        shared.fill(g, 1, got[t].inputs.data() + g * s, got[t].targets.data() + g * s,
                    got[t].positions.data() + g * s);
      }
    });
  }
  for (std::thread& th : threads) th.join();
  for (int t = 0; t < 8; ++t) {
    CHECK(got[t].inputs == expected.inputs);
    CHECK(got[t].targets == expected.targets);
  }
}

TEST_CASE("loader: bad options and too little data are UserErrors", "[cpu][data]") {
  TempDir dir;
  TokenLoaderOptions o = identity_options(dir, 8, 8, 0);
  CHECK_USER_ERROR(TokenLoader(o),
                   "the data is too small for seq_len 8: 8 tokens in 1 file give 0 window(s) of "
                   "seq_len+1 tokens, leaving no training window (need at least 9 tokens)");
  o = identity_options(dir, 9, 8, 0);
  CHECK(TokenLoader(o).num_train_windows() == 1);
  o.valid_fraction = 0.2;
  CHECK_USER_ERROR(TokenLoader(o),
                   "1 held out for validation, leaving no training window (need "
                   "at least 17 tokens)");
  o = identity_options(dir, 4, 8, 0);
  o.valid_fraction = 0.2;
  CHECK_USER_ERROR(TokenLoader(o),
                   "4 tokens in 1 file give 0 window(s) of seq_len+1 tokens, "
                   "leaving no training window (need at least 17 tokens)");

  o = identity_options(dir, 20, 4, 0);
  auto with = [&](auto change) {
    TokenLoaderOptions c = o;
    change(c);
    return c;
  };
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.eod_mask_loss = true; })),
                   "eod_mask_loss needs eos_id");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.reset_position_ids = true; })),
                   "reset_position_ids needs eos_id");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.eos_id = 20; })),
                   "eos_id 20 is outside the vocabulary (vocab_size 20");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.valid_fraction = 0.5; })),
                   "valid_fraction must be in [0, 0.5) (got 0.5)");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.vocab_size = 0; })), "vocab_size must be");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.seq_len = 0; })), "seq_len must be at least 1");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.flat_dtype = "int16"; })),
                   "flat token dtype must be uint16 or uint32");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.paths.clear(); })), "no data paths given");
  CHECK_USER_ERROR(TokenLoader(with([](auto& c) { c.format = "text"; })),
                   "data format must be auto, megatron or flat");
}

TEST_CASE("loader: out-of-vocabulary tokens fail the window that reads them", "[cpu][data]") {
  TempDir dir;
  TokenLoaderOptions o = identity_options(dir, 1 + 4 * 4, 4, 5);
  o.vocab_size = 14;  // tokens 14, 15, 16 (in window 3: stream [12, 17)) are out of range
  TokenLoader loader(o);
  const std::string expected =
      o.paths[0] + ": token 14 at position 14 is outside the vocabulary (vocab_size 14)";
  for (int g = 0; g < 4; ++g) {
    if (loader.train_window(g) == 3) {
      CHECK(test::user_error_of([&] { fill(loader, g, 1); }) == expected);
    } else {
      CHECK(fill(loader, g, 1).num_valid_targets == 4);
    }
  }
  CHECK(test::user_error_of([&] { loader.validate_all_tokens(); }) == expected);
}
