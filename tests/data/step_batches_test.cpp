// StepBatches (data/step_batches.h): the samples each data-parallel rank reads for a step are the
// trainer's formula's — micro-batch m of rank r reads consumed + (m·dp + r)·b … +b — and the ranks
// together read the step's consecutive samples once each; a slice sees whole sequences and its
// tokens land in the micro-batch; evaluation batches read the validation split. On an identity
// stream (token at stream position p is p), so a sequence's first id names its window.
#include <algorithm>
#include <map>
#include <numeric>
#include <vector>

#include "catch.h"
#include "data/loader.h"
#include "data/step_batches.h"
#include "data_test_util.h"
#include "test_util.h"

using namespace mop;
using test::TempDir;

namespace {

constexpr int kSeq = 4;
constexpr int32_t kPoison = -7;

// 11 training windows (a prime, so steps cross epochs at odd places) of an identity stream; one
// target masked (after the input eos 2·S + 2, in the tail the slice below keeps), so the counts
// are not all b·S.
TokenLoaderOptions identity_options(const TempDir& dir, double valid_fraction) {
  const int64_t windows = valid_fraction > 0 ? 14 : 11, n = 1 + windows * kSeq;
  std::vector<int64_t> tokens(size_t(n), 0);
  std::iota(tokens.begin(), tokens.end(), 0);
  test::write_file(dir / "identity.u32", test::token_bytes(tokens, 4));
  TokenLoaderOptions o;
  o.paths = {dir / "identity.u32"};
  o.format = "flat";
  o.flat_dtype = "uint32";
  o.vocab_size = n;
  o.seq_len = kSeq;
  o.seed = 5;
  o.eos_id = 2 * kSeq + 2;
  o.eod_mask_loss = true;
  o.valid_fraction = valid_fraction;
  return o;
}

struct Read {
  std::vector<int32_t> ids, targets, positions;
  int64_t valid = 0;
};

Read read_train(const TokenLoader& loader, int64_t first, int num_samples) {
  Read r;
  const size_t n = size_t(num_samples) * size_t(loader.seq_len());
  r.ids.assign(n, kPoison), r.targets.assign(n, kPoison), r.positions.assign(n, kPoison);
  r.valid = loader.fill(first, num_samples, r.ids.data(), r.targets.data(), r.positions.data());
  return r;
}

Read read_valid(const TokenLoader& loader, int64_t first, int num_samples) {
  Read r;
  const size_t n = size_t(num_samples) * size_t(loader.seq_len());
  r.ids.assign(n, kPoison), r.targets.assign(n, kPoison), r.positions.assign(n, kPoison);
  r.valid =
      loader.fill_valid(first, num_samples, r.ids.data(), r.targets.data(), r.positions.data());
  return r;
}

// The last `local_seq` tokens of each of the b sequences of `whole`, and their unmasked targets.
Read tail_of(const Read& whole, int b, int local_seq) {
  Read r;
  for (int q = 0; q < b; ++q)
    for (int l = kSeq - local_seq; l < kSeq; ++l) {
      const size_t from = size_t(q * kSeq + l);
      r.ids.push_back(whole.ids[from]);
      r.targets.push_back(whole.targets[from]);
      r.positions.push_back(whole.positions[from]);
      r.valid += whole.targets[from] >= 0;
    }
  return r;
}

void poison(StepBatches& batches) {
  const BatchGeometry& g = batches.geometry();
  for (int m = 0; m < g.micro_batches; ++m) {
    StepBatches::HostMicroBatch h = batches.micro_batch(m);
    std::fill_n(h.ids, g.micro_batch_tokens(), kPoison);
    std::fill_n(h.targets, g.micro_batch_tokens(), kPoison);
    std::fill_n(h.positions, g.micro_batch_tokens(), kPoison);
  }
}

// Elements of micro-batch m that differ from `want`'s tokens [from, from + b·local_seq).
int64_t wrong_in(StepBatches& batches, int m, const Read& want, size_t from) {
  const StepBatches::HostMicroBatch h = batches.micro_batch(m);
  int64_t wrong = 0;
  for (int64_t t = 0; t < batches.geometry().micro_batch_tokens(); ++t) {
    wrong += h.ids[t] != want.ids[from + size_t(t)];
    wrong += h.targets[t] != want.targets[from + size_t(t)];
    wrong += h.positions[t] != want.positions[from + size_t(t)];
  }
  return wrong;
}

}  // namespace

TEST_CASE(
    "step batches: rank r's micro-batch m reads samples consumed + (m·dp + r)·b, the ranks "
    "read the step's samples once each",
    "[cpu][data]") {
  TempDir dir;
  TokenLoader loader(identity_options(dir, 0.0));
  for (int dp : {1, 2, 3})
    for (int b : {1, 2})
      for (int micro_batches : {1, 3})
        for (int64_t consumed : {int64_t(0), int64_t(7), int64_t(31)}) {
          INFO("dp " << dp << " b " << b << " micro-batches " << micro_batches << " consumed "
                     << consumed);
          const int step_samples = micro_batches * dp * b;
          // The step's samples in order, and the windows every rank reads (window → times).
          const Read whole = read_train(loader, consumed, step_samples);
          std::map<int64_t, int> windows_read;
          int64_t valid = 0, wrong = 0;
          for (int r = 0; r < dp; ++r) {
            StepBatches batches(loader, BatchGeometry{b, kSeq, micro_batches, dp, r});
            poison(batches);
            const int64_t rank_valid = batches.fill_step(consumed);
            int64_t want_valid = 0;
            for (int m = 0; m < micro_batches; ++m) {
              const int64_t first = consumed + (int64_t(m) * dp + r) * b;  // the trainer's formula
              const Read want = read_train(loader, first, b);
              wrong += wrong_in(batches, m, want, 0);
              // The same tokens as the step's consecutive samples at the formula's offset.
              wrong += wrong_in(batches, m, whole, size_t(first - consumed) * kSeq);
              want_valid += want.valid;
              for (int q = 0; q < b; ++q)
                ++windows_read[batches.micro_batch(m).ids[q * kSeq] / kSeq];
            }
            CHECK(rank_valid == want_valid);
            valid += rank_valid;
          }
          CHECK(wrong == 0);
          CHECK(valid == whole.valid);
          std::map<int64_t, int> step_windows;
          for (int64_t g = consumed; g < consumed + step_samples; ++g)
            ++step_windows[loader.train_window(g)];
          CHECK(windows_read == step_windows);
        }
}

TEST_CASE(
    "step batches: a slice keeps its tokens of whole sequences, evaluation reads the "
    "validation split",
    "[cpu][data]") {
  TempDir dir;
  TokenLoader loader(identity_options(dir, 0.2));
  REQUIRE(loader.num_valid_windows() > 1);
  const int dp = 2, b = 2, micro_batches = 2, local_seq = kSeq / 2;
  const int64_t consumed = 9;
  for (int r = 0; r < dp; ++r) {
    INFO("dp rank " << r);
    // Keeps the last local_seq tokens of each sequence; counts the reads.
    int reads = 0;
    StepBatches::Slice keep_tail = [&](const StepBatches::Read& read, int32_t* ids,
                                       int32_t* targets, int32_t* positions) {
      ++reads;
      Read whole;
      whole.ids.assign(size_t(b) * kSeq, kPoison);
      whole.targets = whole.positions = whole.ids;
      read(whole.ids.data(), whole.targets.data(), whole.positions.data());
      const Read tail = tail_of(whole, b, local_seq);
      std::copy(tail.ids.begin(), tail.ids.end(), ids);
      std::copy(tail.targets.begin(), tail.targets.end(), targets);
      std::copy(tail.positions.begin(), tail.positions.end(), positions);
      return tail.valid;
    };
    StepBatches batches(loader, BatchGeometry{b, local_seq, micro_batches, dp, r}, keep_tail);
    poison(batches);
    const int64_t valid = batches.fill_step(consumed);
    CHECK(reads == micro_batches);
    int64_t want_valid = 0, wrong = 0;
    for (int m = 0; m < micro_batches; ++m) {
      const Read want =
          tail_of(read_train(loader, consumed + (int64_t(m) * dp + r) * b, b), b, local_seq);
      wrong += wrong_in(batches, m, want, 0);
      want_valid += want.valid;
    }
    CHECK(wrong == 0);
    CHECK(valid == want_valid);

    // Evaluation batch i: validation samples (i·dp + r)·b … +b, into micro-batch 0, sliced too.
    for (int64_t i : {0, 1, 4}) {
      poison(batches);
      reads = 0;
      const int64_t eval_valid = batches.fill_eval(i);
      CHECK(reads == 1);
      const Read want = tail_of(read_valid(loader, (i * dp + r) * b, b), b, local_seq);
      CHECK(wrong_in(batches, 0, want, 0) == 0);
      CHECK(eval_valid == want.valid);
      CHECK(batches.micro_batch(1).ids[0] == kPoison);  // only micro-batch 0 is written
    }
  }
}
