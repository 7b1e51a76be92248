// Host AdamW: every ISA path bitwise equal to the reference adamw_step (make_cpu_ops) for f32 and
// bf16 gradients over sizes around the vector widths, values from denormal to overflowing,
// special values, and bias corrections of step 1 and 1000; the bf16 output equals float_to_bf16 of
// the master weights and nothing is written past the range; a weights-only pass (bf16 or f32 out,
// state untouched) then a state-only pass give the one-pass bits; 1, 2 and 3 threads give the same
// bits; several tickets in flight. ThreadPool: coverage, pinning, FP environment, CPU shares.
// A hidden benchmark ("[.bench][host_adamw]") reports params/s and GB/s.
#include <pthread.h>
#include <sched.h>

#include <atomic>
#include <cfenv>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

#if defined(__x86_64__)
#include <immintrin.h>  // SSE2 (x86-64 baseline) non-temporal stores for the bandwidth ceiling
#endif

#include "ops/ops_test_util.h"
#include "optim/host_adamw.h"
#include "optim/host_adamw_bench.h"
#include "runtime/memory.h"

using namespace mop;
using namespace mop::test;

namespace {

constexpr int64_t kGuard = 16;        // bf16 output elements past the range that must stay put
constexpr uint16_t kPoison = 0xdead;  // their value (and the output's before the update)

uint32_t bits_of(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}
float float_of(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Random sign and magnitude 2^e with e uniform in [-149, 80]: denormals, normals, and values whose
// square (g·g) overflows to inf; one in 16 is ±0.
float wide_value(uint64_t seed, uint64_t i) {
  const uint64_t r = philox_u64(seed, 13, i);
  if ((r & 15) == 0) return (r & 16) ? -0.0f : 0.0f;
  const int e = int((r >> 8) % 230) - 149;
  const float x = std::ldexp(1.0f + float((r >> 32) & 0x7fffff) / 8388608.0f, e);
  return (r & 32) ? -x : x;
}

enum class Fill { Typical, Wide };

// Optimizer state and a gradient of n elements. Typical: a trained model's ranges (weights
// ~0.05, m ~1e-3, v ~1e-6, gradients ~1e-3). Wide: wide_value everywhere, v = |wide_value|.
struct State {
  HostTensor master, m, v, grad;
  // Not inlined: inlined into the test loops, GCC 12 reports a false -Wmaybe-uninitialized on
  // Tensor::numel's loop over the shape.
  [[gnu::noinline]] State(int64_t n, DType grad_dtype, Fill fill, uint64_t seed)
      : master(DType::F32, {n}), m(DType::F32, {n}), v(DType::F32, {n}), grad(grad_dtype, {n}) {
    if (fill == Fill::Typical) {
      fill_random(master, seed, -0.05, 0.05);
      fill_random(m, seed + 1, -1e-3, 1e-3);
      fill_random(v, seed + 2, 0, 1e-6);
      fill_random(grad, seed + 3, -2e-3, 2e-3);
      return;
    }
    for (int64_t i = 0; i < n; ++i) {
      master.set(i, wide_value(seed, uint64_t(i)));
      m.set(i, wide_value(seed + 1, uint64_t(i)));
      v.set(i, std::fabs(wide_value(seed + 2, uint64_t(i))));
      grad.set(i, wide_value(seed + 3, uint64_t(i)));
    }
  }
};

// The bias corrections of `step` as the trainer forms them.
AdamWArgs make_args(int step, float weight_decay, float grad_scale) {
  AdamWArgs a;
  a.lr = 3e-3f;
  a.weight_decay = weight_decay;
  a.grad_scale = grad_scale;
  a.bias_correction1 = 1.0f - std::pow(a.beta1, float(step));
  a.bias_correction2 = 1.0f - std::pow(a.beta2, float(step));
  return a;
}

std::vector<AdamWArgs> args_grid() {
  return {make_args(1, 0, 1), make_args(1, 0.1f, 0.37f), make_args(1000, 0.1f, 0.37f),
          make_args(1000, 0, 1)};
}

std::vector<SimdIsa> supported_isas() {
  std::vector<SimdIsa> isas;
  for (SimdIsa isa : {SimdIsa::Scalar, SimdIsa::Avx2, SimdIsa::Avx512}) {
    if (simd_isa_supported(isa))
      isas.push_back(isa);
    else
      WARN("this CPU lacks " << simd_isa_name(isa) << ": its path is not tested here");
  }
  return isas;
}

// Elements whose bits differ, and the first of them (−1 when none): a failure names a reproducer.
struct Mismatch {
  int64_t count = 0, first = -1;
};
Mismatch compare_bits(const HostTensor& a, const HostTensor& b) {
  Mismatch r;
  for (int64_t i = 0; i < a.numel(); ++i)
    if (bits_of(a.ptr<float>()[i]) != bits_of(b.ptr<float>()[i]) && r.count++ == 0) r.first = i;
  return r;
}

// A bf16 output of n elements, poisoned, between `lead` and kGuard poisoned elements that must
// stay put. Varying `lead` moves the output against vector alignment (the kernels stream aligned
// stores after a scalar prologue).
struct WeightsOut {
  std::vector<bf16> data;
  int64_t lead;
  explicit WeightsOut(int64_t n, int64_t lead_ = 0)
      : data(size_t(lead_ + n + kGuard), bf16{kPoison}), lead(lead_) {}
  bf16* ptr() { return data.data() + lead; }
  const bf16& operator[](int64_t i) const { return data[size_t(lead + i)]; }
};

// Checks `got` (after the host update) against `ref` (after the reference step): master, m and v
// bit for bit; weights = float_to_bf16(master) everywhere; the guard untouched.
void check_state(const State& got, const State& ref, const WeightsOut& weights) {
  const int64_t n = ref.master.numel();
  for (auto [name, a, b] : {std::tuple{"master", &got.master, &ref.master},
                            std::tuple{"m", &got.m, &ref.m}, std::tuple{"v", &got.v, &ref.v}}) {
    const Mismatch mm = compare_bits(*a, *b);
    INFO(name << ": " << mm.count << " of " << n << " elements differ, first at " << mm.first
              << (mm.first >= 0 ? " (got " + std::to_string(a->get(mm.first)) + ", want " +
                                      std::to_string(b->get(mm.first)) + ")"
                                : std::string()));
    CHECK(mm.count == 0);
  }
  int64_t bad_weights = 0, bad_guard = 0;
  for (int64_t i = 0; i < n; ++i)
    bad_weights += weights[i].bits != float_to_bf16(ref.master.ptr<float>()[i]).bits;
  for (int64_t i = -weights.lead; i < 0; ++i) bad_guard += weights[i].bits != kPoison;
  for (int64_t i = n; i < n + kGuard; ++i) bad_guard += weights[i].bits != kPoison;
  CHECK(bad_weights == 0);
  CHECK(bad_guard == 0);
}

// The reference step on a copy of `s`.
State reference_after(const State& s, const AdamWArgs& args) {
  State ref = s;
  cpu_ops().adamw_step(ref.master, ref.m, ref.v, ref.grad, args);
  return ref;
}

// Runs every supported ISA on a copy of `s` (directly, on this thread) against the reference,
// with the bf16 output `lead` elements into its buffer.
void check_all_isas(const State& s, const AdamWArgs& args, int64_t lead = 0) {
  const State ref = reference_after(s, args);
  for (SimdIsa isa : supported_isas()) {
    INFO("isa " << simd_isa_name(isa) << ", output lead " << lead);
    State got = s;
    WeightsOut w(s.master.numel(), lead);
    host_adamw_update(host_adamw_range(got.master, got.m, got.v, got.grad,
                                       Tensor(w.ptr(), DType::BF16, {s.master.numel()})),
                      args, isa);
    check_state(got, ref, w);
  }
}

}  // namespace

TEST_CASE("host AdamW: every ISA is bitwise equal to the reference adamw_step", "[cpu][optim]") {
  for (DType grad_dt : {DType::F32, DType::BF16})
    for (int64_t n : {0, 1, 15, 16, 17, 1000003})
      for (Fill fill : {Fill::Typical, Fill::Wide}) {
        const State s(n, grad_dt, fill, 100 + uint64_t(n));
        const std::vector<AdamWArgs> grid = args_grid();
        for (size_t k = 0; k < grid.size(); ++k) {
          const AdamWArgs& args = grid[k];
          const int64_t lead = int64_t(k % 4) * 5;  // output 0, 10, 20 or 30 bytes in
          INFO("grad " << dtype_name(grad_dt) << ", n " << n << ", fill "
                       << (fill == Fill::Wide ? "wide" : "typical") << ", args " << k << " (wd "
                       << args.weight_decay << ", grad_scale " << args.grad_scale << ", bc1 "
                       << args.bias_correction1 << ", bc2 " << args.bias_correction2 << ")");
          check_all_isas(s, args, lead);
        }
      }
}

TEST_CASE("host AdamW: a weights pass then a state pass equal one pass, bit for bit", "[cpu][optim]") {
  // The overlapped host step writes the new weights first, reading the state only, and writes
  // master, m and v in a second pass: the weights (bf16 or f32) must be those of the reference,
  // the state untouched after the first pass and the reference's after the second.
  for (SimdIsa isa : supported_isas())
    for (DType grad_dt : {DType::F32, DType::BF16})
      for (int64_t n : {0, 1, 17, 100003})
        for (Fill fill : {Fill::Typical, Fill::Wide})
          for (DType w_dt : {DType::BF16, DType::F32}) {
            INFO("isa " << simd_isa_name(isa) << ", grad " << dtype_name(grad_dt) << ", n " << n
                        << ", weights " << dtype_name(w_dt));
            const State s(n, grad_dt, fill, 300 + uint64_t(n));
            const AdamWArgs args = make_args(7, 0.1f, 0.37f);
            const State ref = reference_after(s, args);
            State got = s;
            WeightsOut w16(n, 3);
            HostTensor w32(DType::F32, {n});
            Tensor weights = w_dt == DType::BF16 ? Tensor(w16.ptr(), DType::BF16, {n}) : w32.t;
            HostAdamWRange first = host_adamw_range(got.master, got.m, got.v, got.grad, weights);
            first.write_state = false;
            host_adamw_update(first, args, isa);
            CHECK(compare_bits(got.master, s.master).count == 0);
            CHECK(compare_bits(got.m, s.m).count == 0);
            CHECK(compare_bits(got.v, s.v).count == 0);
            host_adamw_update(host_adamw_range(got.master, got.m, got.v, got.grad), args, isa);
            if (w_dt == DType::BF16) {
              check_state(got, ref, w16);
            } else {
              CHECK(compare_bits(w32, ref.master).count == 0);
              check_state(got, ref, [&] {  // the bf16 check on the reference's own rounding
                WeightsOut rounded(n);
                for (int64_t i = 0; i < n; ++i)
                  rounded.ptr()[i] = float_to_bf16(ref.master.ptr<float>()[i]);
                return rounded;
              }());
            }
          }
}

TEST_CASE("host AdamW: inputs are rich enough to mean something", "[cpu][optim]") {
  // The wide fill must reach denormals, zeros and overflow of g·g, or the test above proves less.
  const State s(100000, DType::F32, Fill::Wide, 7);
  int64_t denormal = 0, zero = 0, overflow = 0;
  for (int64_t i = 0; i < s.grad.numel(); ++i) {
    const float g = s.grad.ptr<float>()[i];
    denormal += std::fpclassify(g) == FP_SUBNORMAL;
    zero += g == 0;
    overflow += std::isinf(g * g);
  }
  CHECK(denormal > 100);
  CHECK(zero > 1000);
  CHECK(overflow > 1000);
  // And the update moves typical weights, so equality is not that of untouched arrays.
  const State t(1000, DType::BF16, Fill::Typical, 8);
  const State ref = reference_after(t, make_args(1, 0.1f, 1));
  CHECK(max_abs_diff(ref.master, t.master) > 1e-4);
}

TEST_CASE("host AdamW: NaN, inf and negative-v propagate as in the reference", "[cpu][optim]") {
  // One non-finite source per element (or ones that meet only in non-commutative ops: m/v, p−u).
  // Where two different NaNs meet in an add or multiply, x86 returns the first operand's payload
  // and the compiler may order commutative operands either way, so that case is not pinned down.
  const int64_t n = 16 * 14 + 5;  // full vectors and a tail
  for (DType grad_dt : {DType::F32, DType::BF16}) {
    INFO("grad " << dtype_name(grad_dt));
    State s(n, grad_dt, Fill::Typical, 21);
    // Bits are written directly: a float → double → float round trip would quiet a signalling
    // NaN, and HostTensor::set rounds bf16 through float_to_bf16, which quiets it too.
    // The NaNs' low halves would carry into the top half (0x7fffffff even into the sign) if
    // float_to_bf16 rounded NaNs like numbers.
    const uint32_t qnan = 0x7fc0c234u, snan = 0xff80c321u, qnan2 = 0x7fffffffu;
    const uint32_t inf = 0x7f800000u, big = bits_of(3e38f);  // g·g overflows
    auto set_grad = [&](int64_t i, uint32_t u) {
      if (grad_dt == DType::BF16)  // the top half; the signalling NaN's top half is -inf, so +1
        s.grad.ptr<bf16>()[i] = bf16{uint16_t(u >> 16 | (u == snan ? 1 : 0))};
      else
        s.grad.ptr<float>()[i] = float_of(u);
    };
    auto set = [](HostTensor& t, int64_t i, uint32_t u) { t.ptr<float>()[i] = float_of(u); };
    for (int64_t i = 0; i < n; ++i) {
      // One line per case reads as a table.
      // clang-format off
      switch (i % 14) {
        case 0: set_grad(i, qnan); break;
        case 1: set_grad(i, snan); break;
        case 2: set_grad(i, inf); break;
        case 3: set_grad(i, inf | 0x80000000u); break;
        case 4: set(s.m, i, qnan); break;
        case 5: set(s.v, i, snan); break;
        case 6: set(s.master, i, qnan2); break;
        case 7: set(s.m, i, inf | 0x80000000u); break;
        case 8: set(s.v, i, inf); break;
        case 9: set(s.master, i, inf); break;
        case 10: set(s.v, i, bits_of(-1e-6f)); break;  // sqrt of a negative: the default NaN
        case 11: set(s.m, i, qnan), set(s.v, i, qnan2); break;  // meet in the division only
        case 12: set(s.master, i, qnan2), set_grad(i, qnan); break;  // meet in p − u only
        case 13: set_grad(i, big); break;
      }
      // clang-format on
    }
    for (const AdamWArgs& args : args_grid()) check_all_isas(s, args);
  }
}

TEST_CASE("host AdamW: 1, 2 and 3 pool threads give the reference bits", "[cpu][optim]") {
  const int64_t n = 1000003;  // 31 chunks of kHostAdamWChunk, the last one short and ragged
  for (DType grad_dt : {DType::F32, DType::BF16}) {
    const State s(n, grad_dt, Fill::Wide, 5);
    const AdamWArgs args = make_args(3, 0.1f, 0.5f);
    const State ref = reference_after(s, args);
    for (int threads : {1, 2, 3}) {
      INFO("grad " << dtype_name(grad_dt) << ", threads " << threads);
      ThreadPool pool(threads);
      REQUIRE(pool.num_threads() == threads);
      State got = s;
      WeightsOut w(n, 3);
      host_adamw_run(
          pool,
          host_adamw_range(got.master, got.m, got.v, got.grad, Tensor(w.ptr(), DType::BF16, {n})),
          args);
      check_state(got, ref, w);
    }
  }
}

TEST_CASE("host AdamW: several tickets in flight, waited in any order", "[cpu][optim]") {
  // One flat state cut into per-"layer" ranges (an empty one included), each with its own step
  // arguments, all submitted before any is waited for — the trainer's per-layer pattern.
  const int64_t sizes[] = {70001, 0, 1, 17, 100000, 3 * kHostAdamWChunk + 5};
  int64_t total = 0;
  for (int64_t sz : sizes) total += sz;
  const State s(total, DType::BF16, Fill::Typical, 9);
  State got = s;
  WeightsOut w(total);
  const HostAdamWRange all =
      host_adamw_range(got.master, got.m, got.v, got.grad, Tensor(w.ptr(), DType::BF16, {total}));
  ThreadPool pool(2);
  std::vector<ThreadPool::Ticket> tickets;
  std::vector<AdamWArgs> layer_args;
  int64_t begin = 0;
  for (int64_t sz : sizes) {
    layer_args.push_back(make_args(int(layer_args.size()) + 1, 0.1f, 0.8f));
    tickets.push_back(host_adamw_submit(pool, all.slice(begin, begin + sz), layer_args.back()));
    begin += sz;
  }
  for (size_t k = tickets.size(); k-- > 0;) {
    pool.wait(tickets[k]);
    CHECK(pool.done(tickets[k]));
  }
  // The reference, range by range.
  begin = 0;
  State ref = s;
  for (size_t k = 0; k < std::size(sizes); ++k) {
    const int64_t end = begin + sizes[k];
    cpu_ops().adamw_step(ref.master.t.rows(begin, end), ref.m.t.rows(begin, end),
                         ref.v.t.rows(begin, end), ref.grad.t.rows(begin, end), layer_args[k]);
    begin = end;
  }
  check_state(got, ref, w);
}

TEST_CASE("host AdamW: bad arguments are refused before anything runs", "[cpu][optim]") {
  HostTensor p(DType::F32, {8}), m(DType::F32, {8}), v(DType::F32, {8}), g(DType::BF16, {8});
  HostTensor g64(DType::F64, {8}), g7(DType::F32, {7}), w64(DType::F64, {8});
  CHECK_NOTHROW(host_adamw_range(p, m, v, g));
  CHECK_THROWS_AS(host_adamw_range(p, m, v, g7), Error);
  CHECK_THROWS_AS(host_adamw_range(p, m, v, g, w64), Error);
  HostAdamWRange nothing = host_adamw_range(p, m, v, g);  // neither state nor weights out
  nothing.write_state = false;
  CHECK_THROWS_AS(host_adamw_update(nothing, make_args(1, 0, 1)), Error);
  CHECK_THROWS_AS(host_adamw_range(g, m, v, g), Error);
  AdamWArgs args = make_args(1, 0, 1);
  CHECK_THROWS_AS(host_adamw_update(host_adamw_range(p, m, v, g64), args), Error);
  args.bias_correction1 = 0;
  ThreadPool pool(1);
  CHECK_THROWS_AS(host_adamw_submit(pool, host_adamw_range(p, m, v, g), args), Error);
}

TEST_CASE("ThreadPool: chunks cover the range once; pinning; FP environment", "[cpu][optim]") {
  const std::vector<int> cpus = allowed_cpus();
  REQUIRE(!cpus.empty());

  SECTION("every element once, chunks contiguous and aligned to the chunk size") {
    ThreadPool pool(3);
    for (int64_t n : {0, 1, 99, 100, 101, 12345}) {
      std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
      std::atomic<int> bad_chunks{0};
      pool.run(n, 100, [&](int64_t b, int64_t e) {
        if (b % 100 != 0 || e - b > 100 || e <= b) ++bad_chunks;
        for (int64_t i = b; i < e; ++i) ++hits[size_t(i)];
      });
      int64_t wrong = 0;
      for (auto& h : hits) wrong += h.load() != 1;
      CHECK(wrong == 0);
      CHECK(bad_chunks == 0);
    }
  }
  SECTION("workers run only on their CPU") {
    ThreadPool pool(2, {cpus.back()});
    CHECK(pool.worker_cpus() == std::vector<int>{cpus.back(), cpus.back()});
    std::atomic<int> elsewhere{0};
    pool.run(64, 1, [&](int64_t, int64_t) { elsewhere += sched_getcpu() != cpus.back(); });
    CHECK(elsewhere == 0);
    ThreadPool all;  // default: one worker per allowed CPU
    CHECK(all.worker_cpus() == cpus);
  }
  SECTION("a CPU outside the allowed set is refused") {
    CHECK_THROWS_AS(ThreadPool(1, {CPU_SETSIZE - 1}), Error);
  }
  SECTION("chunks run under the submitter's rounding mode") {
    ThreadPool pool(2);
    std::atomic<int> wrong{0};
    REQUIRE(std::fesetround(FE_UPWARD) == 0);
    auto ticket =
        pool.submit(8, 1, [&](int64_t, int64_t) { wrong += std::fegetround() != FE_UPWARD; });
    std::fesetround(FE_TONEAREST);
    pool.wait(ticket);
    CHECK(wrong == 0);
    pool.run(8, 1, [&](int64_t, int64_t) { wrong += std::fegetround() != FE_TONEAREST; });
    CHECK(wrong == 0);
  }
  SECTION("many tickets; wait_all; the destructor finishes queued work") {
    std::atomic<int64_t> sum{0};
    {
      ThreadPool pool(2);
      std::vector<ThreadPool::Ticket> tickets;
      for (int k = 0; k < 50; ++k)
        tickets.push_back(pool.submit(1000, 64, [&](int64_t b, int64_t e) { sum += e - b; }));
      pool.wait(tickets[25]);
      CHECK(pool.done(tickets[25]));
      pool.wait_all();
      for (auto t : tickets) CHECK(pool.done(t));
      CHECK(sum == 50 * 1000);
      for (int k = 0; k < 10; ++k)
        pool.submit(1000, 64, [&](int64_t b, int64_t e) { sum += e - b; });
    }
    CHECK(sum == 60 * 1000);
  }
}

TEST_CASE("cpu_share splits a CPU list into contiguous near-equal parts", "[cpu][optim]") {
  const std::vector<int> cpus = {0, 1, 2, 3, 4, 5, 6, 7};
  CHECK(cpu_share(cpus, 0, 3) == std::vector<int>{0, 1, 2});
  CHECK(cpu_share(cpus, 1, 3) == std::vector<int>{3, 4, 5});
  CHECK(cpu_share(cpus, 2, 3) == std::vector<int>{6, 7});
  CHECK(cpu_share(cpus, 0, 1) == cpus);
  CHECK(cpu_share({4, 9}, 2, 3) == std::vector<int>{4});  // more parts than CPUs: shared
  CHECK_THROWS_AS(cpu_share(cpus, 1, 1), Error);
}

// ---- benchmark ----------------------------------------------------------------------------------
// Bytes per parameter (the update is bandwidth bound): master, m, v read and written (3 × 8), the
// bf16 gradient read (2), the bf16 weights written (2) = 28. Each configuration is validated
// against the reference on a prefix, then timed over whole-range steps. The ceiling is a loop over
// the same streams with trivial arithmetic (weights streamed too), timed alternately with the
// update so both see the same machine (a shared VM's bandwidth drifts); the in-cache line (a range
// that fits in L2/L3) shows the arithmetic rate. Run with: mop_tests "[host_adamw]".
namespace {

constexpr double kBytesPerParam = 28;
constexpr int kBenchReps = 4;

double seconds_of(const std::function<void()>& f) {
  const auto t0 = std::chrono::steady_clock::now();
  f();
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

void print_rate(const std::string& what, int threads, int64_t n, double seconds,
                double ceiling_seconds = 0) {
  std::printf("%-28s %2d thread(s) %8.3fM params: %8.2f ms %6.3f G params/s %6.1f GB/s",
              what.c_str(), threads, n * 1e-6, seconds * 1e3, n / seconds * 1e-9,
              n * kBytesPerParam / seconds * 1e-9);
  if (ceiling_seconds > 0) std::printf("  (%.0f%% of ceiling)", 100 * ceiling_seconds / seconds);
  std::printf("\n");
}

volatile float g_one = 1.0f;  // read once per chunk: the compiler cannot fold the multiply away

}  // namespace

TEST_CASE("bench: host AdamW, 200M params, bf16 grads and weights", "[.bench][host_adamw]") {
  constexpr int64_t kParams = 200'000'000;
  constexpr int64_t kInCache = int64_t(1) << 18;  // 7 MB of traffic
  HostAdamWBenchState state(kParams, MemKind::Host);
  const HostAdamWRange& r = state.r;
  // The update's streams: 3 f32 arrays read and written, the gradient read, the weights written
  // with non-temporal stores; 8 parameters per step (chunks start 64 KiB-aligned in these
  // 256-byte-aligned buffers, and kHostAdamWChunk is a multiple of 8). SSE2 is the x86-64
  // baseline, so this is explicit vector code everywhere the kernels run.
  auto stream = [&](int64_t b, int64_t e) {
    const uint64_t* g = static_cast<const uint64_t*>(r.grad);
    uint64_t* w = reinterpret_cast<uint64_t*>(r.weights);
#if defined(__x86_64__)
    const __m128 one = _mm_set1_ps(g_one);
    for (int64_t i = b; i < e; i += 8) {
      for (int64_t k = i; k < i + 8; k += 4) {
        _mm_storeu_ps(r.master + k, _mm_mul_ps(_mm_loadu_ps(r.master + k), one));
        _mm_storeu_ps(r.m + k, _mm_mul_ps(_mm_loadu_ps(r.m + k), one));
        _mm_storeu_ps(r.v + k, _mm_mul_ps(_mm_loadu_ps(r.v + k), one));
      }
      _mm_stream_si128(reinterpret_cast<__m128i*>(w + i / 4),
                       _mm_load_si128(reinterpret_cast<const __m128i*>(g + i / 4)));
    }
    _mm_sfence();
#else
    const float one = g_one;
    for (int64_t i = b; i < e; ++i) r.master[i] *= one, r.m[i] *= one, r.v[i] *= one;
    for (int64_t i = b / 4; i < e / 4; ++i) w[i] = g[i];
#endif
  };
  const AdamWArgs args = make_args(10, 0.1f, 1);

  const int max_threads = int(allowed_cpus().size());
  for (int threads : {max_threads, 1}) {
    ThreadPool pool(threads);
    state.fill(pool);
    for (SimdIsa isa : {SimdIsa::Avx512, SimdIsa::Avx2, SimdIsa::Scalar}) {
      if (!simd_isa_supported(isa)) continue;
      REQUIRE(state.validate(pool, args, isa).empty());
      double update = 1e30, ceiling = 1e30;
      for (int k = 0; k < kBenchReps; ++k) {
        ceiling =
            std::min(ceiling, seconds_of([&] { pool.run(kParams, kHostAdamWChunk, stream); }));
        update = std::min(update, seconds_of([&] { host_adamw_run(pool, r, args, isa); }));
      }
      double in_cache = 1e30;
      for (int k = 0; k < 50; ++k)
        in_cache = std::min(
            in_cache, seconds_of([&] { host_adamw_run(pool, r.slice(0, kInCache), args, isa); }));
      const std::string name = "host AdamW " + std::string(simd_isa_name(isa));
      print_rate(name, threads, kParams, update, ceiling);
      print_rate(name + " in cache", threads, kInCache, in_cache);
      if (isa == SimdIsa::Avx512 || !simd_isa_supported(SimdIsa::Avx512))
        print_rate("stream ceiling", threads, kParams, ceiling);
    }
  }
  // The reference (OpenMP, no bf16 output) for scale.
  Tensor tm(r.master, DType::F32, {kParams}), tmm(r.m, DType::F32, {kParams}),
      tv(r.v, DType::F32, {kParams}), tg(state.grad.data(), DType::BF16, {kParams});
  print_rate("reference adamw_step (OpenMP)", omp_get_max_threads(), kParams,
             seconds_of([&] { cpu_ops().adamw_step(tm, tmm, tv, tg, args); }));
}
