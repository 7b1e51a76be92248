// SequenceSlicer (parallel/sequence_parallel.h): which tokens of whole sequences a cp rank keeps,
// checked against the chunk layout both attentions assume, and the unmasked targets it counts.
#include <set>
#include <vector>

#include "catch.h"
#include "parallel/sequence_parallel.h"

using namespace mop;

namespace {

// Token s of sequence q reads id 1000·q + s, position s, and a target masked where s % 3 == 1, so
// every value names where it came from.
int64_t read_whole(int batch, int seq, int32_t* ids, int32_t* targets, int32_t* positions) {
  int64_t valid = 0;
  for (int q = 0; q < batch; ++q)
    for (int s = 0; s < seq; ++s) {
      const int i = q * seq + s;
      ids[i] = 1000 * q + s;
      targets[i] = s % 3 == 1 ? -1 : 1000 * q + s + 1;
      positions[i] = s;
      valid += targets[i] >= 0;
    }
  return valid;
}

}  // namespace

TEST_CASE("sequence slicer: a cp rank keeps chunks r and 2cp-1-r of every sequence",
          "[cpu][parallel]") {
  for (int cp : {2, 3, 4})
    for (int chunk : {1, 3})
      for (int batch : {1, 2}) {
        const int seq = 2 * cp * chunk, sl = seq / cp;
        INFO("cp " << cp << " chunk " << chunk << " batch " << batch);
        std::vector<int32_t> whole_ids(size_t(batch * seq)), whole_targets = whole_ids,
                                                             whole_positions = whole_ids;
        const int64_t whole_valid =
            read_whole(batch, seq, whole_ids.data(), whole_targets.data(), whole_positions.data());
        int64_t kept_valid = 0;
        std::multiset<int> kept_tokens;
        for (int r = 0; r < cp; ++r) {
          SequenceSlicer slicer(batch, seq, cp, r);
          REQUIRE(slicer.local_seq() == sl);
          // Ring attention's layout (ring_attention.h): the early chunk r, then its mirror; the
          // Ulysses exchange builds its maps from zigzag_positions, which must be the same.
          std::vector<int> want;
          for (int i = 0; i < chunk; ++i) want.push_back(r * chunk + i);
          for (int i = 0; i < chunk; ++i) want.push_back((2 * cp - 1 - r) * chunk + i);
          CHECK(zigzag_positions(seq, cp, r) == want);
          std::vector<int32_t> ids(size_t(batch * sl), -7), targets = ids, positions = ids;
          const int64_t valid = slicer.fill(
              [&](int32_t* i, int32_t* t, int32_t* p) { return read_whole(batch, seq, i, t, p); },
              ids.data(), targets.data(), positions.data());
          int64_t want_valid = 0, wrong = 0;
          for (int q = 0; q < batch; ++q)
            for (int l = 0; l < sl; ++l) {
              const int s = want[size_t(l)], to = q * sl + l;
              wrong += ids[size_t(to)] != 1000 * q + s;
              wrong += targets[size_t(to)] != (s % 3 == 1 ? -1 : 1000 * q + s + 1);
              wrong += positions[size_t(to)] != s;
              want_valid += s % 3 != 1;
              kept_tokens.insert(ids[size_t(to)]);
            }
          CHECK(wrong == 0);
          CHECK(valid == want_valid);
          kept_valid += valid;
        }
        // The cp ranks together keep every token once, and every unmasked target.
        CHECK(kept_tokens.size() == size_t(batch * seq));
        CHECK(std::set<int>(kept_tokens.begin(), kept_tokens.end()).size() == size_t(batch * seq));
        CHECK(kept_valid == whole_valid);
      }
}

TEST_CASE("sequence slicer: with cp 1 the read lands untouched, with its own count",
          "[cpu][parallel]") {
  const int batch = 2, seq = 7;  // odd: cp 1 needs no chunks
  SequenceSlicer slicer(batch, seq, 1, 0);
  CHECK(slicer.local_seq() == seq);
  std::vector<int32_t> ids(size_t(batch * seq)), targets = ids, positions = ids;
  std::vector<int32_t> want_ids = ids, want_targets = ids, want_positions = ids;
  const int64_t want =
      read_whole(batch, seq, want_ids.data(), want_targets.data(), want_positions.data());
  const int32_t* where = nullptr;
  const int64_t valid = slicer.fill(
      [&](int32_t* i, int32_t* t, int32_t* p) {
        where = i;
        return read_whole(batch, seq, i, t, p);
      },
      ids.data(), targets.data(), positions.data());
  CHECK(where == ids.data());  // no staging copy
  CHECK(valid == want);
  CHECK(ids == want_ids);
  CHECK(targets == want_targets);
  CHECK(positions == want_positions);
}
