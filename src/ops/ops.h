// The op interface: every computation of the model's step, forward and backward, listed once in
// op_list.inc. `Ops` is the front model code calls: each op checks its tensors' shapes, dtypes and
// devices once (src/ops/<stem>.cpp), then calls its hook on the backend — the CPU reference
// (src/ops/cpu/, plain loops in float and double) or CUDA (src/ops/cuda/ and kernels/) — with an
// observer (the step's timer) told of every op. Backends implement only the hooks.
#pragma once

#include <initializer_list>
#include <memory>
#include <optional>
#include <utility>
#include <vector>

#include "core/tensor.h"
#include "runtime/runtime.h"

namespace mop {

// The argument check the backends share: `t` is on `device` (any device when nullopt), has
// `dtype` and exactly the shape `dims`, and has data when it has elements; otherwise an error
// naming `name` and what was expected.
void expect_tensor(const Tensor& t, const char* name, std::optional<Device> device, DType dtype,
                   std::initializer_list<int64_t> dims);

struct AdamWArgs {
  float lr = 0;
  float beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f;
  float weight_decay = 0;
  float grad_scale = 1;    // gradients are multiplied by this first (clipping)
  float bias_correction1 = 1;  // 1 - beta1^step
  float bias_correction2 = 1;  // 1 - beta2^step
};

// The largest shapes a run passes to the ops (tokens, sequences, heads, …), so a backend can build
// its plans and size its workspaces once, before the first step.
struct OpShapes {
  int64_t max_tokens = 0;  // T of the largest micro-batch
  int64_t batch = 0, seq = 0;
  int64_t heads = 0, kv_heads = 0, head_dim = 0;
  int64_t hidden = 0, experts = 0, top_k = 0, expert_ffn = 0, vocab = 0;
  int64_t lm_head_chunk = 0;
  // Ring attention (parallel/ring_attention.h) also runs the non-causal attention of this shape.
  bool attention_non_causal = false;
};

// Where an op's time is counted in the step's time split (TimedOps, the plan's time model).
enum class OpCategory : uint8_t {
  Attention, DenseGemm, Experts, RouterPermute, Loss, Optimizer, Communication, Other
};
constexpr int kNumOpCategories = 8;
const char* op_category_name(OpCategory c);

enum class OpId : uint8_t {
#define MOP_OP(name, category, params, args) name,
#include "ops/op_list.inc"
#undef MOP_OP
};
struct OpInfo {
  const char* name;
  OpCategory category;
};
const OpInfo& op_info(OpId id);

// Told of every op the front issues, around its hook (TimedOps times them this way).
class OpObserver {
 public:
  virtual ~OpObserver() = default;
  virtual void op_begin(OpId id) = 0;
  virtual void op_end() = 0;
};

// What a backend implements: one hook per op of op_list.inc, called by the front with arguments
// whose shapes, dtypes and devices it has checked; a backend checks only its own limits (sizes
// its kernels take, data it can read cheaply) and the dtypes it computes in.
class OpsBackend {
 public:
  virtual ~OpsBackend() = default;
  virtual Device device() const = 0;
  // The compute dtypes this backend runs (CPU: f32, f64; CUDA: bf16).
  virtual std::vector<DType> compute_dtypes() const = 0;
  // Waits for all queued work (the CPU backend runs synchronously).
  virtual void synchronize() {}
  // The stream the ops are issued on, in order (runtime.h): the null stream on the CPU.
  virtual Stream stream() const { return Stream(); }
  virtual void prepare(const OpShapes& shapes) {}
  virtual size_t workspace_bytes() const { return 0; }

#define MOP_OP(name, category, params, args) virtual void name params = 0;
#include "ops/op_list.inc"
#undef MOP_OP
};

// The front. Not virtual: what varies is the backend (hooks) and the observer.
class Ops {
 public:
  explicit Ops(std::shared_ptr<OpsBackend> backend);
  virtual ~Ops();  // TimedOps adds the timer's state
  Ops(const Ops&) = delete;
  Ops& operator=(const Ops&) = delete;

  Device device() const { return device_; }
  // Waits for all queued work (the CPU backend runs synchronously).
  void synchronize() { backend_->synchronize(); }
  // The stream the ops are issued on, in order (runtime.h): the null stream on the CPU. Other
  // streams order themselves against it through events.
  Stream stream() const { return backend_->stream(); }
  // Builds plans and allocates the backend's internal workspaces for calls up to `shapes`; called
  // before the first step. Calls with other shapes (generation) may build more plans lazily.
  void prepare(const OpShapes& shapes) { backend_->prepare(shapes); }
  // Bytes the backend's internal workspaces hold (part of the planned memory).
  size_t workspace_bytes() const { return backend_->workspace_bytes(); }
  OpsBackend& backend() { return *backend_; }
  const std::shared_ptr<OpsBackend>& shared_backend() const { return backend_; }
  // Told of every op from now on (nullptr: none).
  void set_observer(OpObserver* observer) { observer_ = observer; }

  // The ops, documented in op_list.inc.
#define MOP_OP(name, category, params, args) void name params;
#include "ops/op_list.inc"
#undef MOP_OP

  // The checks the stems' front methods share, each failing with an error that names `name`:
  // `t` has one of this backend's compute dtypes (returned); `t` has the acc dtype of one of them
  // (returned); `t` has `dtype` and exactly `dims` on this backend's device (or in host memory
  // where `host_ok`), with data when it has elements.
  DType compute_dtype(const Tensor& t, const char* name) const;
  DType acc_dtype_of(const Tensor& t, const char* name) const;
  void expect(const Tensor& t, const char* name, DType dtype, std::initializer_list<int64_t> dims,
              bool host_ok = false) const;

 private:
  // Runs a hook between the observer's begin and end.
  template <class Hook, class... Args>
  void run(OpId id, Hook hook, Args&&... args) {
    if (!observer_) return (backend_.get()->*hook)(std::forward<Args>(args)...);
    observer_->op_begin(id);
    struct End {
      OpObserver* o;
      ~End() { o->op_end(); }
    } end{observer_};
    (backend_.get()->*hook)(std::forward<Args>(args)...);
  }

  std::shared_ptr<OpsBackend> backend_;
  Device device_;
  std::vector<DType> compute_dtypes_;
  OpObserver* observer_ = nullptr;
};

// The CPU reference backend (always available).
std::unique_ptr<Ops> make_cpu_ops();
// The CUDA backend (binaries built with MOP_CUDA; see cuda_ops.h) on GPU local_rank % #GPUs of
// this host: one GPU per local rank.
std::unique_ptr<Ops> make_cuda_ops(int local_rank);
// The backend of `device`: make_cpu_ops() or make_cuda_ops(local_rank); a CUDA device in a binary
// built without CUDA is a user error.
std::unique_ptr<Ops> make_ops(Device device, int local_rank = 0);

}  // namespace mop
