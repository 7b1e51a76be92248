// Core utilities: bf16 rounding, tensor views, arenas, Philox.
#include <functional>
#include <string>

#include "catch.h"
#include "core/rng.h"
#include "runtime/memory.h"
#include "test_util.h"

using namespace mop;

TEST_CASE("bf16 rounds to nearest even and keeps NaN", "[cpu][core]") {
  CHECK(round_bf16(1.0f) == 1.0f);
  // 1 + 2^-8 is exactly half-way between bf16 neighbours 1 and 1+2^-7: ties go to even (1).
  CHECK(round_bf16(1.0f + 1.0f / 256) == 1.0f);
  CHECK(round_bf16(1.0f + 3.0f / 256) == 1.0f + 4.0f / 256);
  CHECK(std::isnan(round_bf16(std::nanf(""))));
  CHECK(std::isinf(round_bf16(INFINITY)));
}

TEST_CASE("tensor views: rows, at, view", "[cpu][core]") {
  test::HostTensor x(DType::F32, {3, 4, 5});
  for (int i = 0; i < 60; ++i) x.set(i, i);
  Tensor r = x.t.rows(1, 3);
  CHECK(r.numel() == 40);
  CHECK(r.ptr<float>()[0] == 20);
  Tensor a = x.t.at(2);
  CHECK(a.ndim == 2);
  CHECK(a.shape[0] == 4);
  CHECK(a.ptr<float>()[0] == 40);
  CHECK(x.t.view({12, 5}).shape[0] == 12);
  CHECK(x.t.rows(1, 1).row_numel() == 20);  // zero rows still have a row width
  CHECK_THROWS_AS(x.t.view({7, 5}), Error);
  CHECK_THROWS_AS(x.t.rows(2, 4), Error);
}

TEST_CASE("arena aligns slots and zero-fills", "[cpu][core]") {
  Arena arena(MemKind::Host, "test");
  int a = arena.add(DType::F32, {3});
  int b = arena.add(DType::BF16, {5, 7});
  arena.allocate();
  Tensor ta = arena.tensor(a), tb = arena.tensor(b);
  CHECK(reinterpret_cast<uintptr_t>(tb.data) % kArenaAlign == 0);
  CHECK(static_cast<char*>(tb.data) - static_cast<char*>(ta.data) == 256);
  CHECK(ta.ptr<float>()[2] == 0.0f);
  CHECK(arena.planned_bytes() == 512);
}

TEST_CASE("arena views lie in their slot's bytes and add nothing; one that does not fit is refused",
          "[cpu][core]") {
  Arena arena(MemKind::Host, "test");
  int head = arena.add_view(1, 0, Tensor(nullptr, DType::F32, {4}));  // before its slot
  int whole = arena.add(DType::F32, {128});
  int tail = arena.add_view(whole, 256, Tensor(nullptr, DType::F32, {64}));
  arena.add(DType::F32, {1});
  CHECK(arena.planned_bytes() == 512 + 256);
  arena.allocate();
  const char* base = static_cast<char*>(arena.tensor(whole).data);
  CHECK(static_cast<char*>(arena.tensor(head).data) == base);
  CHECK(static_cast<char*>(arena.tensor(tail).data) == base + 256);
  CHECK(arena.tensor(tail).numel() == 64);
  const auto error_of = [](const std::function<void()>& fn) -> std::string {
    try {
      fn();
    } catch (const Error& e) {
      return e.what();
    }
    return "";
  };
  Arena over(MemKind::Host, "over");
  over.add_view(over.add(DType::F32, {128}), 256, Tensor(nullptr, DType::F32, {65}));
  CHECK(error_of([&] { over.allocate(); }).find("does not fit in slot 0") != std::string::npos);
  Arena odd(MemKind::Host, "odd");
  CHECK(error_of([&] { odd.add_view(0, 4, Tensor(nullptr, DType::F32, {1})); }).find("not aligned") !=
        std::string::npos);
}

TEST_CASE("philox is a pure function of key, stream and index", "[cpu][core]") {
  CHECK(philox_u64(1, 2, 3) == philox_u64(1, 2, 3));
  CHECK(philox_u64(1, 2, 3) != philox_u64(1, 2, 4));
  CHECK(philox_u64(1, 2, 3) != philox_u64(2, 2, 3));
  // Normal draws: mean ≈ 0, variance ≈ 1 over 100k samples (4σ bounds: 0.013 and 0.018).
  double s = 0, s2 = 0;
  const int n = 100000;
  for (int i = 0; i < n; ++i) {
    double z = philox_normal(42, 9, uint64_t(i));
    s += z;
    s2 += z * z;
  }
  CHECK(std::fabs(s / n) < 0.013);
  CHECK(std::fabs(s2 / n - 1) < 0.018);
}
