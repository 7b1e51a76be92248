// Exact sums of non-negative reals in fixed point, for the global gradient norm: each term is
// truncated to a multiple of 2^-64 and added as an integer, so a sum is the same whatever the order
// of its terms and however they are split over ranks, blocks or threads. Used by the sumsq op's
// CPU reference and CUDA kernel (op_list.inc says which terms) and by the optimizer, which adds the
// parameters' sums over the ranks exactly.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define MOP_HOST_DEVICE __host__ __device__
#else
#define MOP_HOST_DEVICE
#endif

namespace mop {

// The sumsq op's blocks (op_list.inc): a tensor's exact sum of squares is the sum of its pieces'
// when they start at multiples of this many elements.
constexpr int kSumsqBlock = 64;

// A sum in units of 2^-64 as a 192-bit unsigned integer (words[0] lowest): terms below 2^-64
// vanish, sums reach 2^128 (beyond: `bad`, as for a non-finite term).
struct ExactSum {
  uint64_t words[3] = {0, 0, 0};
  uint64_t bad = 0;  // 1: a term was not finite (or negative), or the sum reached 2^128

  // Adds the 192-bit integer (a0, a1, a2); a carry out of the top word is an overflow.
  MOP_HOST_DEVICE void add_words(uint64_t a0, uint64_t a1, uint64_t a2) {
    uint64_t s0 = words[0] + a0;
    uint64_t c = s0 < a0;
    uint64_t s1 = words[1] + a1;
    uint64_t c1 = s1 < a1;
    s1 += c;
    c1 |= s1 < c;
    uint64_t s2 = words[2] + a2;
    uint64_t c2 = s2 < a2;
    s2 += c1;
    c2 |= s2 < c1;
    words[0] = s0, words[1] = s1, words[2] = s2;
    bad |= c2;
  }
  MOP_HOST_DEVICE void add(const ExactSum& o) {
    add_words(o.words[0], o.words[1], o.words[2]);
    bad |= o.bad;
  }
  // Adds floor(d · 2^64) for a finite d ≥ 0; marks the sum bad otherwise.
  MOP_HOST_DEVICE void add_double(double d) {
    uint64_t u;
    std::memcpy(&u, &d, sizeof u);
    const int biased = int((u >> 52) & 0x7ff);
    if (biased == 0x7ff || (u >> 63 && (u << 1) != 0)) {  // inf, nan, or below zero
      bad = 1;
      return;
    }
    uint64_t m = u & ((uint64_t(1) << 52) - 1);
    int e = biased;
    if (biased != 0)
      m |= uint64_t(1) << 52;
    else
      e = 1;  // subnormal
    if (m == 0) return;
    // d = m · 2^(e - 1075) = m · 2^(shift) units of 2^-64.
    const int shift = e - 1075 + 64;
    if (shift < 0) {
      if (shift > -64) add_words(m >> -shift, 0, 0);
      return;
    }
    if (shift + 53 > 192) {
      bad = 1;
      return;
    }
    const int word = shift / 64, off = shift % 64;
    const uint64_t lo = m << off, hi = off ? m >> (64 - off) : 0;
    uint64_t a[4] = {0, 0, 0, 0};
    a[word] = lo, a[word + 1] = hi;
    if (a[3] != 0) {
      bad = 1;
      return;
    }
    add_words(a[0], a[1], a[2]);
  }
  // The sum as the nearest double (infinity when bad).
  double value() const {
    if (bad) return INFINITY;
    return std::ldexp(double(words[2]), 64) + double(words[1]) + std::ldexp(double(words[0]), -64);
  }

  // Exchanged as doubles holding 32-bit pieces (exact in a double's 53 bits, and so are their sums
  // over fewer than 2^21 ranks): a sum over ranks of to_pieces adds up exactly, from_pieces
  // carries it back into words.
  static constexpr int kPieces = 7;  // six 32-bit pieces and the bad flag
  void to_pieces(double* out) const {
    for (int i = 0; i < 6; ++i) out[i] = double((words[i / 2] >> (32 * (i % 2))) & 0xffffffffu);
    out[6] = double(bad);
  }
  static ExactSum from_pieces(const double* in) {
    ExactSum s;
    for (int i = 0; i < 6; ++i) {
      const uint64_t piece = uint64_t(in[i]);
      ExactSum t;
      const int bit = 32 * i;
      t.words[bit / 64] = piece << (bit % 64);
      if (bit % 64 && bit / 64 + 1 < 3)
        t.words[bit / 64 + 1] = piece >> (64 - bit % 64);
      else if (bit % 64 && (piece >> (64 - bit % 64)) != 0)
        t.bad = 1;
      s.add(t);
    }
    s.bad |= in[6] != 0;
    return s;
  }
};

}  // namespace mop
