// The bounded expert exchange checked on any comm of host tensors (MPI ranks in
// distributed_test.cpp, in-process ranks in expert_exchange_test.cpp): linear experts y_e = x_e·W_eᵀ
// run through the dispatcher forward and backward with receive buffers of B rows, the way the
// model runs them (rounds: the backward sends the input rows again and the weight gradients add up
// from zeros; one round: the kept rows, written gradients). Counts are skewed, expert 1 gets no
// rows from anyone and the last rank's experts none at all. Results are compared bit for bit with
// buffers for the worst case; the rounds' rows, concatenated, must be the worst case's local rows.
#pragma once

#include <cstring>
#include <string>
#include <vector>

#include "parallel/collective_checks.h"
#include "parallel/expert_dispatch.h"

namespace mop::test {

struct ExchangeRun {
  std::vector<float> out, dx, dw;  // forward output, input gradient, local experts' dW
  std::vector<float> local_rows;   // every row the experts saw, in the order they saw them
  int rounds = 0;
  int64_t rows_in = 0, most_rows = 0;  // rows received; most rows of any chunk (≤ B)
};

// Rows rank s routes to global expert e of 3·R; rank 0 sends the most.
inline int exchange_count(int R, int s, int e) {
  if (e == 1 || e / 3 == R - 1) return 0;
  return (s * 7 + e * 3) % 5 + (s == 0 ? 4 : 0);
}

// A value of a few mantissa bits' variety from (a, b, c), reproducible on every rank.
inline float exchange_value(int a, int b, int c) {
  uint32_t h = uint32_t(a) * 2654435761u ^ uint32_t(b) * 40503u ^ uint32_t(c) * 97u;
  h ^= h >> 13, h *= 0x5bd1e995u, h ^= h >> 15;
  return float(int(h % 2001) - 1000) / 997.0f;
}

// One forward and backward on this rank with receive buffers of `budget_rows` rows.
inline ExchangeRun run_exchange(Comm& comm, Ops& ops, int64_t budget_rows, int chunks) {
  const int R = comm.size(), me = comm.rank(), E = 3 * R, El = 3, W = 5;
  std::vector<int32_t> counts(static_cast<size_t>(E));
  int64_t rows_out = 0;
  for (int e = 0; e < E; ++e) rows_out += counts[size_t(e)] = exchange_count(R, me, e);
  std::vector<float> in(size_t(rows_out * W)), dy(in.size()), w(size_t(El * W * W));
  for (int64_t i = 0; i < rows_out * W; ++i)
    in[size_t(i)] = exchange_value(me, int(i), 1), dy[size_t(i)] = exchange_value(me, int(i), 2);
  for (int i = 0; i < El * W * W; ++i) w[size_t(i)] = exchange_value(me * El + i / (W * W), i, 3);
  ExpertDispatcher disp(comm, comm, ops, E, budget_rows, chunks);
  disp.plan(counts.data());
  const int64_t B = std::max<int64_t>(budget_rows, 1);
  std::vector<float> xl(size_t(B * W), -7), yl(xl), scratch(xl), dyl(xl), dxl(xl), xl_again(xl);
  auto t = [&](std::vector<float>& v, int64_t rows) { return Tensor(v.data(), DType::F32, {rows, W}); };
  ExchangeRun run;
  run.rounds = disp.num_rounds(), run.rows_in = disp.rows_in();
  run.out.assign(in.size(), -7), run.dx.assign(in.size(), -7), run.dw.assign(w.size(), -7);
  const int64_t held = disp.rows_held();
  Tensor tw(w.data(), DType::F32, {El, W, W}), tdw(run.dw.data(), DType::F32, {El, W, W});
  disp.run(t(in, rows_out), t(run.out, rows_out), t(xl, held), t(yl, held), t(scratch, B),
           [&](const ExpertDispatcher::Chunk& k) {
             run.most_rows = std::max(run.most_rows, k.rows);
             const float* x = xl.data() + k.row0 * W;
             run.local_rows.insert(run.local_rows.end(), x, x + k.rows * W);
             ops.grouped_gemm_fwd(t(yl, held).rows(k.row0, k.row0 + k.rows),
                                  t(xl, held).rows(k.row0, k.row0 + k.rows), tw.rows(k.e0, k.e1),
                                  k.offsets);
           });
  auto backward = [&](const ExpertDispatcher::Chunk& k, std::vector<float>& x, bool write) {
    const int64_t r0 = k.row0, r1 = k.row0 + k.rows;
    ops.grouped_gemm_bwd_data(t(dxl, held).rows(r0, r1), t(dyl, held).rows(r0, r1), tw.rows(k.e0, k.e1),
                              k.offsets);
    ops.grouped_gemm_bwd_weight(tdw.rows(k.e0, k.e1), t(dyl, held).rows(r0, r1), t(x, held).rows(r0, r1),
                                k.offsets, !write);
  };
  if (disp.num_rounds() > 1) {
    ops.fill(tdw, 0);
    Tensor xin = t(in, rows_out);
    disp.run(t(dy, rows_out), t(run.dx, rows_out), t(dyl, held), t(dxl, held), t(scratch, B),
             [&](const ExpertDispatcher::Chunk& k) { backward(k, xl_again, false); }, &xin,
             t(xl_again, held));
  } else {
    for (int c = 0; c < disp.num_chunks(); ++c)
      if (!disp.chunk(c).rows) ops.fill(tdw.rows(disp.chunk(c).e0, disp.chunk(c).e1), 0);
    disp.run(t(dy, rows_out), t(run.dx, rows_out), t(dyl, held), t(dxl, held), t(scratch, B),
             [&](const ExpertDispatcher::Chunk& k) { backward(k, xl, true); });
  }
  return run;
}

inline bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

// Budgets from one row to past the worst case, against the worst case's buffers.
inline void check_bounded_exchange(Comm& comm, Ops& ops) {
  const int R = comm.size();
  int64_t worst = 0, most_in = 0;  // rows of the whole group; the most any rank receives
  for (int q = 0; q < R; ++q) {
    int64_t in_q = 0;
    for (int s = 0; s < R; ++s)
      for (int e = 3 * q; e < 3 * q + 3; ++e) in_q += exchange_count(R, s, e);
    worst += in_q, most_in = std::max(most_in, in_q);
  }
  for (int chunks : {1, 2}) {
    const ExchangeRun ref = run_exchange(comm, ops, worst, chunks);
    RANK_CHECK(ref.rounds == 1);
    for (int64_t budget : {int64_t(1), int64_t(3), int64_t(7), most_in / 2, most_in - 1, most_in, worst + 5}) {
      if (budget < 1) continue;
      const ExchangeRun run = run_exchange(comm, ops, budget, chunks);
      const std::string what = "R " + std::to_string(R) + " rank " + std::to_string(comm.rank()) +
                               " budget " + std::to_string(budget) + " chunks " + std::to_string(chunks);
      std::lock_guard<std::mutex> lock(rank_check_mutex());  // no collective inside
      INFO(what);
      CHECK(run.rounds == std::max<int64_t>(1, (most_in + budget - 1) / budget));
      CHECK(run.most_rows <= budget);
      CHECK(run.rows_in == ref.rows_in);
      CHECK(same_bits(run.local_rows, ref.local_rows));
      CHECK(same_bits(run.out, ref.out));
      CHECK(same_bits(run.dx, ref.dx));
      CHECK(same_bits(run.dw, ref.dw));
    }
  }
}

}  // namespace mop::test
