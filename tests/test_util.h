// Shared test helpers: owning host tensors, deterministic fills, comparisons with named tolerances.
#pragma once

#include <stdlib.h>

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <functional>
#include <stdexcept>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

#include "core/error.h"
#include "core/rng.h"
#include "core/tensor.h"
#include "parallel/launch.h"

#ifdef MOP_HAVE_CUDA
#include <cuda_runtime.h>
#endif

namespace mop::test {

inline bool launched_by_mpi() { return mop::launched_by_mpi(); }

// A config text with `extra`'s keys laid over `base`'s, section by section (configs refuse a key
// given twice, so tests that vary a base config merge instead of appending).
inline void merge_yaml_into(YAML::Node into, const YAML::Node& extra) {
  for (const auto& kv : extra) {
    const std::string key = kv.first.Scalar();
    if (into[key] && into[key].IsMap() && kv.second.IsMap())
      merge_yaml_into(into[key], kv.second);
    else
      into[key] = kv.second;
  }
}
inline std::string merge_yaml(const std::string& base, const std::string& extra) {
  YAML::Node out = YAML::Load(base);
  const YAML::Node more = YAML::Load(extra);
  if (more && more.IsMap()) merge_yaml_into(out, more);
  YAML::Emitter e;
  e << out;
  return std::string(e.c_str()) + "\n";
}

inline bool gpu_available() {
#ifdef MOP_HAVE_CUDA
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess && n > 0;
#else
  return false;
#endif
}

// A fresh directory under the system temp dir, removed with everything in it at scope exit.
struct TempDir {
  std::filesystem::path path;
  TempDir() {
    std::string tmpl = (std::filesystem::temp_directory_path() / "mop_test_XXXXXX").string();
    if (!::mkdtemp(tmpl.data())) throw std::runtime_error("mkdtemp failed");
    path = tmpl;
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::string operator/(const std::string& name) const { return (path / name).string(); }
};

// A host tensor that owns its storage (8-byte aligned; enough for every dtype).
struct HostTensor {
  std::vector<uint64_t> storage;
  Tensor t;
  HostTensor() = default;
  HostTensor(DType dtype, std::initializer_list<int64_t> dims) {
    t = Tensor(nullptr, dtype, dims);
    storage.assign((t.bytes() + 7) / 8 + 1, 0);
    t.data = storage.data();
  }
  HostTensor(const HostTensor& o) : storage(o.storage), t(o.t) { t.data = storage.data(); }
  HostTensor& operator=(const HostTensor& o) {
    storage = o.storage;
    t = o.t;
    t.data = storage.data();
    return *this;
  }
  operator Tensor() const { return t; }
  template <class T>
  T* ptr() const { return t.ptr<T>(); }
  int64_t numel() const { return t.numel(); }
  // Element i as double, whatever the float dtype.
  double get(int64_t i) const {
    switch (t.dtype) {
      case DType::F32: return t.ptr<float>()[i];
      case DType::F64: return t.ptr<double>()[i];
      case DType::BF16: return bf16_to_float(t.ptr<bf16>()[i]);
      case DType::I32: return t.ptr<int32_t>()[i];
      default: return 0;
    }
  }
  void set(int64_t i, double v) {
    switch (t.dtype) {
      case DType::F32: t.ptr<float>()[i] = float(v); break;
      case DType::F64: t.ptr<double>()[i] = v; break;
      case DType::BF16: t.ptr<bf16>()[i] = float_to_bf16(float(v)); break;
      case DType::I32: t.ptr<int32_t>()[i] = int32_t(v); break;
      default: break;
    }
  }
};

// Uniform values in [lo, hi), rounded through bf16 so they are exact in every float dtype.
inline void fill_uniform(HostTensor& x, uint64_t seed, double lo = -1, double hi = 1) {
  for (int64_t i = 0; i < x.numel(); ++i) {
    double u = double(philox_u64(seed, 7, uint64_t(i)) >> 11) / 9007199254740992.0;
    x.set(i, round_bf16(float(lo + (hi - lo) * u)));
  }
}

inline double max_abs_diff(const HostTensor& a, const HostTensor& b) {
  double m = 0;
  for (int64_t i = 0; i < a.numel(); ++i) m = std::max(m, std::fabs(a.get(i) - b.get(i)));
  return m;
}

// Normalised mean squared error Σ(a−b)² / Σb² (ggml's test metric).
inline double nmse(const HostTensor& a, const HostTensor& ref) {
  double num = 0, den = 0;
  for (int64_t i = 0; i < a.numel(); ++i) {
    double d = a.get(i) - ref.get(i);
    num += d * d;
    den += ref.get(i) * ref.get(i);
  }
  return den == 0 ? num : num / den;
}

// The message of the UserError fn() throws, or "" when it returns normally. Any other exception
// propagates and fails the test.
inline std::string user_error_of(const std::function<void()>& fn) {
  try {
    fn();
  } catch (const UserError& e) {
    return e.what();
  }
  return "";
}

}  // namespace mop::test

// Checks that `expr` throws a UserError whose message contains `text` (use in Catch2 tests).
#define CHECK_USER_ERROR(expr, text)                                          \
  do {                                                                        \
    std::string mop_msg_ = ::mop::test::user_error_of([&] { (void)(expr); }); \
    INFO("UserError message: \"" << mop_msg_ << "\"");                        \
    CHECK(!mop_msg_.empty());                                                 \
    CHECK(mop_msg_.find(text) != std::string::npos);                          \
  } while (0)
