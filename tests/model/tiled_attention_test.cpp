// Attention in query tiles (model/tiled_attention.h) on the CPU reference: for every tile that
// divides the sequence (1 token up to the whole), batch 2 and GQA 2, out, lse, dq, dk and dv equal
// one causal call to fp64 rounding, and to fp32 rounding in fp32; a tile of the whole sequence is
// the plain op bit for bit; sequences that are no multiple of the tile take the plain op; dK/dV
// sums in a buffer the caller lends give the same bits as in the tiled attention's own, and so
// does dq written over dout; the
// plan's buffers are bounded by the tile but for the dK/dV sums. The [gpu] case (cuDNN blocks
// against the reference) is in tests/ops/attention_test.cpp, the whole training step in
// tests/model/long_context_test.cpp.
#include <algorithm>
#include <cmath>
#include <cstring>

#include "catch.h"
#include "model/tiled_attention.h"
#include "test_util.h"

using namespace mop;
using namespace mop::test;

namespace {

constexpr int kBatch = 2;
constexpr int64_t kSeq = 24, kNq = 4, kNkv = 2, kDim = 8;
constexpr int64_t kTokens = kBatch * kSeq;

struct Grads {
  HostTensor out, lse, dq, dk, dv;
};

HostTensor filled(DType dt, std::initializer_list<int64_t> dims, uint64_t seed) {
  HostTensor t(dt, dims);
  fill_uniform(t, seed, -2, 2);
  return t;
}

// One forward and backward through `tile` (0: the plain op); lse returned in the plain layout
// [batch, Nq, S] (a tiled call's is tile-major, see tiled_attention.h).
// lend: the dK/dV sums in a buffer the caller lends (filled with garbage first); dq_in_dout:
// backward writes dq over dout (what the model does when it tiles).
Grads run(Ops& ops, DType dt, int64_t tile, int64_t seq = kSeq, bool lend = false,
          bool dq_in_dout = false) {
  const int64_t T = kBatch * seq;
  const HostTensor q = filled(dt, {T, kNq, kDim}, 1), k = filled(dt, {T, kNkv, kDim}, 2);
  const HostTensor v = filled(dt, {T, kNkv, kDim}, 3);
  HostTensor dout = filled(dt, {T, kNq, kDim}, 4);
  const DType adt = acc_dtype(dt);
  Grads g{HostTensor(dt, {T, kNq, kDim}), HostTensor(adt, {T * kNq}), HostTensor(dt, {T, kNq, kDim}),
          HostTensor(dt, {T, kNkv, kDim}), HostTensor(dt, {T, kNkv, kDim})};
  TiledAttention attn(ops, tile, kSeq, kNq, kNkv, kDim, dt, lend);  // planned for kSeq; seq ≤ kSeq
  HostTensor lent(acc_dtype(dt), {2 * kSeq * kNkv * kDim});
  fill_uniform(lent, 9, -1e3, 1e3);
  const float scale = float(1 / std::sqrt(double(kDim)));
  attn.forward(g.out, g.lse, q, k, v, kBatch, scale);
  attn.backward(dq_in_dout ? dout.t : g.dq.t, g.dk, g.dv, dout, q, k, v, g.out, g.lse, kBatch,
                scale, lend ? Tensor(lent) : Tensor());
  if (dq_in_dout) g.dq = dout;
  if (TiledAttention::tiled(tile, seq) && seq % tile == 0) {  // tile-major → [batch, Nq, S]
    HostTensor plain(adt, {T * kNq});
    for (int64_t b = 0; b < kBatch; ++b)
      for (int64_t s = 0; s < seq; ++s)
        for (int64_t h = 0; h < kNq; ++h) {
          const int64_t i0 = s / tile * tile, tiled_at = (b * seq + i0) * kNq + h * tile + (s - i0);
          plain.set((b * kNq + h) * seq + s, g.lse.get(tiled_at));
        }
    g.lse = plain;
  }
  return g;
}

double max_abs(const HostTensor& t) {
  double m = 0;
  for (int64_t i = 0; i < t.numel(); ++i) m = std::max(m, std::abs(t.get(i)));
  return m;
}

// Largest |a − b| over the largest |b|.
double rel_diff(const HostTensor& a, const HostTensor& b) {
  REQUIRE(a.numel() == b.numel());
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::abs(a.get(i) - b.get(i)));
  return m / std::max(max_abs(b), 1e-300);
}

void check_close(const Grads& got, const Grads& want, double tol) {
  CHECK(rel_diff(got.out, want.out) < tol);
  CHECK(rel_diff(got.lse, want.lse) < tol);
  CHECK(rel_diff(got.dq, want.dq) < tol);
  CHECK(rel_diff(got.dk, want.dk) < tol);
  CHECK(rel_diff(got.dv, want.dv) < tol);
}

bool bitwise_equal(const HostTensor& a, const HostTensor& b) {
  return a.numel() == b.numel() && std::memcmp(a.t.data, b.t.data, a.t.bytes()) == 0;
}

}  // namespace

TEST_CASE("tiled attention equals one causal call for every tile (fp64, fp32)", "[cpu][model]") {
  auto ops = make_cpu_ops();
  // fp64: different summation orders of O(1) values; fp32: the same over a 24-key softmax.
  for (auto [dt, tol] : {std::pair<DType, double>{DType::F64, 1e-12}, {DType::F32, 2e-5}}) {
    const Grads plain = run(*ops, dt, 0);
    CHECK(max_abs(plain.dk) > 0.1);  // the inputs give every gradient a scale to compare
    for (int64_t tile : {1, 2, 3, 4, 6, 8, 12}) {
      INFO(dtype_name(dt) << ", tile " << tile);
      check_close(run(*ops, dt, tile), plain, tol);
    }
  }
}

TEST_CASE("tiled attention with a tile of the whole sequence, or one that does not divide it, is "
          "the plain op bit for bit; lent dK/dV sums change nothing", "[cpu][model]") {
  auto ops = make_cpu_ops();
  const Grads plain = run(*ops, DType::F32, 0);
  for (int64_t tile : {kSeq, 2 * kSeq}) {
    INFO("tile " << tile);
    CHECK(TiledAttention::buffer_bytes(tile, kSeq, kNq, kNkv, kDim, DType::F32) == 0);
    const Grads g = run(*ops, DType::F32, tile);
    CHECK(bitwise_equal(g.out, plain.out));
    CHECK(bitwise_equal(g.lse, plain.lse));
    CHECK(bitwise_equal(g.dq, plain.dq));
    CHECK(bitwise_equal(g.dk, plain.dk));
    CHECK(bitwise_equal(g.dv, plain.dv));
  }
  // The dK/dV sums in a lent buffer: the same results; a buffer too small for them is refused.
  for (int64_t tile : {1, 6}) {
    const Grads own = run(*ops, DType::F32, tile), lent = run(*ops, DType::F32, tile, kSeq, true);
    CHECK(bitwise_equal(lent.dk, own.dk));
    CHECK(bitwise_equal(lent.dv, own.dv));
    CHECK(bitwise_equal(lent.dq, own.dq));
  }
  CHECK(TiledAttention::sums_fit(2 * kSeq * kNkv * kDim * 4, kSeq, kNkv, kDim, DType::F32));
  CHECK_FALSE(TiledAttention::sums_fit(2 * kSeq * kNkv * kDim * 4 - 1, kSeq, kNkv, kDim, DType::F32));
  CHECK(TiledAttention::buffer_bytes(6, kSeq, kNq, kNkv, kDim, DType::F32, true) <
        TiledAttention::buffer_bytes(6, kSeq, kNq, kNkv, kDim, DType::F32));
  // A planned tile of 8 with a shorter sequence of 20 tokens (no multiple of 8): the plain op.
  const Grads short_plain = run(*ops, DType::F32, 0, 20), short_tiled = run(*ops, DType::F32, 8, 20);
  CHECK(bitwise_equal(short_tiled.out, short_plain.out));
  CHECK(bitwise_equal(short_tiled.dq, short_plain.dq));
}

TEST_CASE("tiled attention may write dq over dout: the same bits, tiled or one tile long",
          "[cpu][model]") {
  auto ops = make_cpu_ops();
  for (int64_t tile : {1, 6, 12}) {  // the whole 24-token sequences in tiles
    INFO("tile " << tile);
    const Grads own = run(*ops, DType::F32, tile), shared = run(*ops, DType::F32, tile, kSeq, true, true);
    CHECK(max_abs(own.dq) > 0.1);
    CHECK(bitwise_equal(shared.dq, own.dq));
    CHECK(bitwise_equal(shared.dk, own.dk));
    CHECK(bitwise_equal(shared.dv, own.dv));
  }
  // Sequences of at most one tile (8 tokens against a planned tile of 8 or 12) run as one call
  // each, through the tile's buffers: the plain op's bits.
  for (int64_t tile : {8, 12}) {
    INFO("tile " << tile);
    const Grads plain = run(*ops, DType::F32, 0, 8), shared = run(*ops, DType::F32, tile, 8, false, true);
    CHECK(bitwise_equal(shared.dq, plain.dq));
    CHECK(bitwise_equal(shared.dk, plain.dk));
    CHECK(bitwise_equal(shared.dv, plain.dv));
  }
  // Longer sequences that are no multiple of the tile would need a second dq buffer: refused.
  CHECK_THROWS_WITH(run(*ops, DType::F32, 8, 20, false, true),
                    Catch::Contains("needs sequences of at most one tile"));
}

TEST_CASE("tiled attention's buffers grow with the tile, but for the dK/dV sums of a sequence",
          "[cpu][model][plan]") {
  // q3moe-8l's attention at 1M tokens in bf16: 32 query heads, 4 kv heads of 128.
  const int64_t S = int64_t(1) << 20, Nq = 32, Nkv = 4, D = 128;
  const size_t sums = size_t(2 * S * Nkv * D * 4);  // fp32 dK and dV of one sequence
  const size_t per_tile_token = size_t(Nq * D * (4 + 2 + 4) + Nq * 4 + 2 * Nkv * D * 2);
  for (int64_t tile : {int64_t(8192), int64_t(65536), int64_t(131072)}) {
    INFO("tile " << tile);
    const size_t bytes = TiledAttention::buffer_bytes(tile, S, Nq, Nkv, D, DType::BF16);
    CHECK(bytes >= sums + size_t(tile) * per_tile_token);
    CHECK(bytes <= sums + size_t(tile) * per_tile_token + 8 * 256);  // alignment of 8 parts
  }
  CHECK(TiledAttention::calls_per_sequence(131072, S) == 8 * 9 / 2);
  CHECK(TiledAttention::calls_per_sequence(0, S) == 1);
}
