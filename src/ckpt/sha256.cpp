// SHA-256 from FIPS 180-4 §6.2: 64-byte blocks, a 64-word message schedule, 64 rounds; the
// message is padded with 0x80, zeros, and its length in bits as a big-endian u64.
#include "ckpt/sha256.h"

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

// First 32 bits of the fractional parts of the cube roots of the first 64 primes (§4.2.2).
constexpr uint32_t kRound[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

// First 32 bits of the fractional parts of the square roots of the first 8 primes (§5.3.3).
constexpr std::array<uint32_t, 8> kInit = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
                                           0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};

inline uint32_t rotr(uint32_t x, int n) {
  return (x >> n) | (x << (32 - n));
}

inline uint32_t load_be32(const uint8_t* p) {
  return uint32_t(p[0]) << 24 | uint32_t(p[1]) << 16 | uint32_t(p[2]) << 8 | uint32_t(p[3]);
}

// Hashing reads the file in blocks this large: few system calls, and the block stays in L2/L3.
constexpr size_t kFileBlock = size_t(4) << 20;

}  // namespace

Sha256::Sha256() {
  reset();
}

void Sha256::reset() {
  h_ = kInit;
  buf_len_ = 0;
  total_bytes_ = 0;
  finished_ = false;
}

void Sha256::compress(const uint8_t* block) {
  uint32_t w[64];
  for (int t = 0; t < 16; ++t) w[t] = load_be32(block + 4 * t);
  for (int t = 16; t < 64; ++t) {
    uint32_t s0 = rotr(w[t - 15], 7) ^ rotr(w[t - 15], 18) ^ (w[t - 15] >> 3);
    uint32_t s1 = rotr(w[t - 2], 17) ^ rotr(w[t - 2], 19) ^ (w[t - 2] >> 10);
    w[t] = w[t - 16] + s0 + w[t - 7] + s1;
  }
  uint32_t a = h_[0], b = h_[1], c = h_[2], d = h_[3], e = h_[4], f = h_[5], g = h_[6], h = h_[7];
  for (int t = 0; t < 64; ++t) {
    uint32_t big_s1 = rotr(e, 6) ^ rotr(e, 11) ^ rotr(e, 25);
    uint32_t ch = (e & f) ^ (~e & g);
    uint32_t t1 = h + big_s1 + ch + kRound[t] + w[t];
    uint32_t big_s0 = rotr(a, 2) ^ rotr(a, 13) ^ rotr(a, 22);
    uint32_t maj = (a & b) ^ (a & c) ^ (b & c);
    uint32_t t2 = big_s0 + maj;
    h = g;
    g = f;
    f = e;
    e = d + t1;
    d = c;
    c = b;
    b = a;
    a = t1 + t2;
  }
  h_[0] += a;
  h_[1] += b;
  h_[2] += c;
  h_[3] += d;
  h_[4] += e;
  h_[5] += f;
  h_[6] += g;
  h_[7] += h;
}

void Sha256::update(const void* data, size_t bytes) {
  MOP_CHECK(!finished_, "Sha256::update after finish");
  const auto* p = static_cast<const uint8_t*>(data);
  total_bytes_ += bytes;
  if (buf_len_ > 0) {
    size_t take = std::min(bytes, 64 - buf_len_);
    std::memcpy(buf_.data() + buf_len_, p, take);
    buf_len_ += take;
    p += take;
    bytes -= take;
    if (buf_len_ < 64) return;
    compress(buf_.data());
    buf_len_ = 0;
  }
  for (; bytes >= 64; p += 64, bytes -= 64) compress(p);
  std::memcpy(buf_.data(), p, bytes);
  buf_len_ = bytes;
}

Sha256::Digest Sha256::finish() {
  MOP_CHECK(!finished_, "Sha256::finish called twice");
  uint64_t bit_len = total_bytes_ * 8;
  buf_[buf_len_++] = 0x80;
  if (buf_len_ > 56) {  // no room for the length: pad this block out and use one more
    std::memset(buf_.data() + buf_len_, 0, 64 - buf_len_);
    compress(buf_.data());
    buf_len_ = 0;
  }
  std::memset(buf_.data() + buf_len_, 0, 56 - buf_len_);
  for (int i = 0; i < 8; ++i) buf_[56 + i] = uint8_t(bit_len >> (56 - 8 * i));
  compress(buf_.data());
  finished_ = true;
  Digest out;
  for (int i = 0; i < 8; ++i)
    for (int k = 0; k < 4; ++k) out[4 * i + k] = uint8_t(h_[i] >> (24 - 8 * k));
  return out;
}

std::string Sha256::finish_hex() {
  Digest d = finish();
  return to_hex(d.data(), d.size());
}

std::string to_hex(const uint8_t* bytes, size_t n) {
  static constexpr char kHex[] = "0123456789abcdef";
  std::string s(2 * n, '0');
  for (size_t i = 0; i < n; ++i) {
    s[2 * i] = kHex[bytes[i] >> 4];
    s[2 * i + 1] = kHex[bytes[i] & 15];
  }
  return s;
}

std::string sha256_hex(std::string_view data) {
  Sha256 h;
  h.update(data);
  return h.finish_hex();
}

FileDigest sha256_file(const std::filesystem::path& path) {
  (void)regular_file_size(path, "");  // stat first: open(2) of a FIFO would wait for a writer
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
  if (fd < 0) throw_user_error(path.string(), ": cannot open: ", std::strerror(errno));
  auto buf = std::make_unique<uint8_t[]>(kFileBlock);
  Sha256 h;
  for (;;) {
    ssize_t n = ::read(fd, buf.get(), kFileBlock);
    if (n < 0) {
      if (errno == EINTR) continue;
      int err = errno;
      ::close(fd);
      throw_user_error(path.string(), ": read failed: ", std::strerror(err));
    }
    if (n == 0) break;
    h.update(buf.get(), size_t(n));
  }
  ::close(fd);
  uint64_t bytes = h.bytes_hashed();
  return FileDigest{bytes, h.finish_hex()};
}

}  // namespace mop
