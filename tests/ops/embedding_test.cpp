// embedding: the CPU reference gathers rows and its backward adds repeated ids (finite
// differences); the CUDA backend ([gpu]) exact in forward, and in backward bit for bit where an
// id occurs at most 16 times (within a named tolerance beyond), over repeated, single and
// distinct ids; out-of-range ids are reported at the next embedding call.

#include <cmath>
#include <cstring>
#include <vector>

#include "ops/ops_test_util.h"

namespace reference {
using namespace mop;
using namespace mop::test;

TEST_CASE("embedding gathers rows; backward adds repeated ids (finite differences)", "[cpu][ops]") {
  Ops& ops = cpu_ops();
  const int64_t vocab = 11, hidden = 5, tokens = 7;
  HostTensor ids(DType::I32, {tokens});
  const int32_t id[] = {3, 0, 10, 3, 7, 3, 0};  // repeats, first and last row
  for (int64_t t = 0; t < tokens; ++t) ids.ptr<int32_t>()[t] = id[t];
  HostTensor table = random_tensor(DType::F64, {vocab, hidden}, 4);
  HostTensor out(DType::F64, {tokens, hidden});
  ops.embedding_fwd(out, ids, table);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t h = 0; h < hidden; ++h)
      CHECK(out.get(t * hidden + h) == table.get(id[t] * hidden + h));

  HostTensor weights = random_tensor(DType::F64, {tokens, hidden}, 5);
  auto loss = [&] {
    ops.embedding_fwd(out, ids, table);
    return weighted_sum(weights, out);
  };
  HostTensor d0 = random_tensor(DType::F64, {vocab, hidden}, 6), dtable = d0;
  ops.embedding_bwd(dtable, ids, weights);
  for (int64_t i = 0; i < dtable.numel(); ++i) dtable.set(i, dtable.get(i) - d0.get(i));
  check_grad("embedding table", table, dtable, loss);

  ids.ptr<int32_t>()[2] = int32_t(vocab);
  CHECK_THROWS_AS(ops.embedding_fwd(out, ids, table), Error);
  CHECK_THROWS_AS(ops.embedding_bwd(dtable, ids, weights), Error);
}

}  // namespace reference
#ifdef MOP_HAVE_CUDA

#include "catch.h"
#include "gpu/pointwise_test_util.h"
#include "ops/cuda_ops.h"

namespace cuda {
using namespace mop;
using namespace mop::test;
using namespace mop::test::pw;

namespace {

// Runs of more than 16 tokens are split over 8 warps whose fp32 sums are then added in order:
// the result differs from the reference's sequential sum by a few 2^-24 of |dtable₀| + Σ|dout|.
constexpr double kLongRunRtol = 1e-6;
// Runs of up to this many tokens are summed exactly in the reference's order.
constexpr int kExactRun = 16;

HostTensor ids_tensor(const std::vector<int32_t>& ids) {
  HostTensor t(DType::I32, {int64_t(ids.size())});
  for (size_t i = 0; i < ids.size(); ++i) t.ptr<int32_t>()[i] = ids[i];
  return t;
}

std::vector<int32_t> random_ids(int64_t tokens, int64_t vocab, uint64_t seed) {
  std::vector<int32_t> ids(static_cast<size_t>(tokens));
  for (int64_t t = 0; t < tokens; ++t)
    ids[size_t(t)] = int32_t(philox_u64(seed, 2, uint64_t(t)) % uint64_t(vocab));
  return ids;
}

}  // namespace

TEST_CASE("embedding forward on the device gathers rows exactly", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const int64_t shapes[][4] = {{1, 1, 1, 0},          {5, 7, 3, 0},     {17, 50, 64, 0},
                               {4096, 1000, 2048, 0}, {33, 100, 12, 0}, {9, 20, 64, 1}};
  for (auto& s : shapes) {
    const int64_t tokens = s[0], vocab = s[1], hidden = s[2], offset = s[3];
    INFO("tokens " << tokens << " table [" << vocab << "," << hidden << "] offset " << offset);
    std::vector<int32_t> idv = random_ids(tokens, vocab, 3);
    idv.front() = 0;
    idv.back() = int32_t(vocab - 1);
    const HostTensor ids = ids_tensor(idv);
    const HostTensor table = random_f32({vocab, hidden}, 4);
    HostTensor ref(DType::F32, {tokens, hidden});
    cpu().embedding_fwd(ref, ids, table);
    DeviceTensor d_ids = upload_at(ids, DType::I32),
                 d_table = upload_at(table, DType::BF16, offset);
    DeviceTensor out = poisoned(DType::BF16, {tokens, hidden}, offset);
    ops.embedding_fwd(out.t, d_ids.t, d_table.t);
    CHECK(bitwise_equal(download(out.t), as_dtype(ref, DType::BF16)));
  }
}

TEST_CASE("embedding backward on the device sums each id's rows reproducibly", "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  struct Case {
    const char* name;
    std::vector<int32_t> ids;
    int64_t vocab;
  };
  std::vector<Case> cases;
  {
    // Repeats of every multiplicity, plus runs of exactly 16 and 17 tokens and one of 300.
    std::vector<int32_t> ids = random_ids(4096, 1000, 5);
    for (int32_t& id : ids)
      if (id >= 7 && id <= 9) id += 100;  // 7, 8 and 9 occur only where placed below
    for (int t = 0; t < 300; ++t) ids[size_t(t * 13)] = 7;
    for (int t = 0; t < 17; ++t) ids[size_t(t * 13 + 1)] = 8;
    for (int t = 0; t < 16; ++t) ids[size_t(t * 13 + 2)] = 9;
    cases.push_back({"mixed runs", ids, 1000});
  }
  cases.push_back({"all tokens one id", std::vector<int32_t>(3000, 3), 10});
  {
    std::vector<int32_t> ids(1000);
    for (int i = 0; i < 1000; ++i) ids[size_t(i)] = int32_t((i * 7919) % 1000);  // a permutation
    cases.push_back({"every id distinct", ids, 1000});
  }
  cases.push_back({"one token", {4}, 5});
  for (const Case& c : cases)
    for (int64_t hidden : {int64_t(2048), int64_t(13), int64_t(64), int64_t(1)})
      for (int64_t offset : {0, 1}) {
        if (offset == 1 && hidden != 64) continue;
        const int64_t tokens = int64_t(c.ids.size()), vocab = c.vocab;
        INFO(c.name << ": tokens " << tokens << " table [" << vocab << "," << hidden << "] offset "
                    << offset);
        const HostTensor ids = ids_tensor(c.ids);
        const HostTensor dout = random_f32({tokens, hidden}, 6);
        const HostTensor dtable0 = random_f32({vocab, hidden}, 7);
        HostTensor ref = dtable0;
        cpu().embedding_bwd(ref, ids, dout);
        std::vector<int64_t> count(size_t(vocab), 0);
        std::vector<double> scale(size_t(vocab * hidden));
        for (int64_t i = 0; i < vocab * hidden; ++i) scale[size_t(i)] = std::fabs(dtable0.get(i));
        for (int64_t t = 0; t < tokens; ++t) {
          const int64_t id = c.ids[size_t(t)];
          ++count[size_t(id)];
          for (int64_t h = 0; h < hidden; ++h)
            scale[size_t(id * hidden + h)] += std::fabs(dout.get(t * hidden + h));
        }
        DeviceTensor d_ids = upload_at(ids, DType::I32);
        DeviceTensor d_dout = upload_at(dout, DType::BF16, offset);
        auto run = [&] {
          DeviceTensor d_table = upload_at(dtable0, DType::F32, offset);
          ops.embedding_bwd(d_table.t, d_ids.t, d_dout.t);
          return download(d_table.t);
        };
        const HostTensor got = run();
        int64_t inexact_short = 0, bad = 0;
        for (int64_t v = 0; v < vocab; ++v)
          for (int64_t h = 0; h < hidden; ++h) {
            const int64_t i = v * hidden + h;
            const float g = got.ptr<float>()[i], r = ref.ptr<float>()[i];
            if (count[size_t(v)] <= kExactRun && std::memcmp(&g, &r, sizeof(float)) != 0)
              ++inexact_short;
            if (!(std::fabs(double(g) - double(r)) <= kLongRunRtol * scale[size_t(i)])) ++bad;
          }
        CHECK(inexact_short == 0);
        CHECK(bad == 0);
        CHECK(bitwise_equal(run(), got));
      }
}

TEST_CASE("embedding ids outside the vocabulary are reported at the next call",
          "[gpu][pointwise]") {
  if (skip_without_gpu()) return;
  CudaOps ops;
  const int64_t vocab = 6, hidden = 16;
  const HostTensor table = random_f32({vocab, hidden}, 8);
  const HostTensor bad_ids = ids_tensor({0, 6, -1, 2}), good_ids = ids_tensor({1, 2, 3, 5});
  DeviceTensor d_table = upload_at(table, DType::BF16);
  DeviceTensor d_bad = upload_at(bad_ids, DType::I32), d_good = upload_at(good_ids, DType::I32);
  DeviceTensor out = poisoned(DType::BF16, {4, hidden});

  ops.embedding_fwd(out.t, d_bad.t, d_table.t);
  ops.synchronize();
  // Rows of valid ids are gathered, rows of invalid ones zeroed.
  const HostTensor got = download(out.t);
  for (int64_t h = 0; h < hidden; ++h) {
    CHECK(got.get(0 * hidden + h) == table.get(0 * hidden + h));
    CHECK(got.get(1 * hidden + h) == 0);
    CHECK(got.get(2 * hidden + h) == 0);
    CHECK(got.get(3 * hidden + h) == table.get(2 * hidden + h));
  }
  CHECK_THROWS_AS(ops.embedding_fwd(out.t, d_good.t, d_table.t), Error);
  CHECK_NOTHROW(ops.embedding_fwd(out.t, d_good.t, d_table.t));  // reported once

  const HostTensor dout = random_f32({4, hidden}, 9);
  const HostTensor dtable0 = random_f32({vocab, hidden}, 10);
  DeviceTensor d_dout = upload_at(dout, DType::BF16), d_dtable = upload_at(dtable0, DType::F32);
  ops.embedding_bwd(d_dtable.t, d_bad.t, d_dout.t);
  ops.synchronize();
  // The valid tokens (0 → row 0, 3 → row 2) are added; nothing is written for the others.
  const HostTensor g = download(d_dtable.t);
  for (int64_t h = 0; h < hidden; ++h) {
    CHECK(g.get(0 * hidden + h) == float(dtable0.get(0 * hidden + h) + dout.get(0 * hidden + h)));
    CHECK(g.get(1 * hidden + h) == dtable0.get(1 * hidden + h));
    CHECK(g.get(2 * hidden + h) == float(dtable0.get(2 * hidden + h) + dout.get(3 * hidden + h)));
  }
  CHECK_THROWS_AS(ops.embedding_bwd(d_dtable.t, d_good.t, d_dout.t), Error);
}

}  // namespace cuda
#endif  // MOP_HAVE_CUDA
