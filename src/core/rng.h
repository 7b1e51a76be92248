// Counter-based random numbers (Philox4x32-10, Salmon et al., SC'11): the value at (key, counter)
// is a pure function, so parameter initialisation and data order do not depend on how work is
// split over ranks or threads, and there is no generator state to checkpoint beyond the seed.
#pragma once

#include <cmath>
#include <cstdint>
#include <string_view>

namespace mop {

struct Philox4x32 {
  static constexpr uint32_t kM0 = 0xD2511F53u, kM1 = 0xCD9E8D57u;
  static constexpr uint32_t kW0 = 0x9E3779B9u, kW1 = 0xBB67AE85u;

  // Four 32-bit words for counter (c0..c3) under key (k0, k1).
  static void generate(uint32_t out[4], uint64_t counter_lo, uint64_t counter_hi, uint64_t key) {
    uint32_t c0 = uint32_t(counter_lo), c1 = uint32_t(counter_lo >> 32);
    uint32_t c2 = uint32_t(counter_hi), c3 = uint32_t(counter_hi >> 32);
    uint32_t k0 = uint32_t(key), k1 = uint32_t(key >> 32);
    for (int round = 0; round < 10; ++round) {
      uint64_t p0 = uint64_t(kM0) * c0, p1 = uint64_t(kM1) * c2;
      uint32_t n0 = uint32_t(p1 >> 32) ^ c1 ^ k0, n1 = uint32_t(p1);
      uint32_t n2 = uint32_t(p0 >> 32) ^ c3 ^ k1, n3 = uint32_t(p0);
      c0 = n0, c1 = n1, c2 = n2, c3 = n3;
      k0 += kW0, k1 += kW1;
    }
    out[0] = c0, out[1] = c1, out[2] = c2, out[3] = c3;
  }
};

// Uniform in (0, 1): 24 random bits, offset by half a step so log() below is finite.
inline double philox_uniform_from_bits(uint32_t bits) { return ((bits >> 8) + 0.5) / 16777216.0; }

// Standard normal for element `index` of stream `stream` (Box–Muller on one Philox block).
inline double philox_normal(uint64_t key, uint64_t stream, uint64_t index) {
  uint32_t r[4];
  Philox4x32::generate(r, index, stream, key);
  double u1 = philox_uniform_from_bits(r[0]), u2 = philox_uniform_from_bits(r[1]);
  return std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2);
}

// Uniform 64-bit value for (key, stream, index).
inline uint64_t philox_u64(uint64_t key, uint64_t stream, uint64_t index) {
  uint32_t r[4];
  Philox4x32::generate(r, index, stream, key);
  return (uint64_t(r[0]) << 32) | r[1];
}

// 64-bit FNV-1a: stable stream ids from names ("model.layers.0.mlp.gate.weight").
inline uint64_t fnv1a64(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

}  // namespace mop
