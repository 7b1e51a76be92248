// cuDNN frontend graphs for GQA flash attention (see attention_cudnn.h): graph construction
// per shape and mask, the build steps (validate → operation graph → heuristics → support check →
// plan), and execution with a reused variant pack. Frontend failures become mop::Error
// (or UserError when cuDNN says the shape is not supported).
#include "ops/cuda/attention_cudnn.h"

#include <cudnn.h>

#include <unordered_map>
#include <utility>
#include <vector>

#include "core/error.h"

#ifdef MOP_HAVE_CUDNN_FRONTEND
// The frontend is header-only and not written for -Wall -Wextra (unused static helpers etc.).
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wunused-function"
#pragma GCC diagnostic ignored "-Wunused-variable"
#pragma GCC diagnostic ignored "-Wunused-but-set-variable"
#pragma GCC diagnostic ignored "-Wunused-parameter"
#pragma GCC diagnostic ignored "-Wsign-compare"
#pragma GCC diagnostic ignored "-Wmissing-field-initializers"
#pragma GCC diagnostic ignored "-Wdeprecated-declarations"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#pragma GCC diagnostic ignored "-Wreorder"
#pragma GCC diagnostic ignored "-Wclass-memaccess"
#if __GNUC__ >= 13
#pragma GCC diagnostic ignored "-Wdangling-reference"
#endif
#include <cudnn_frontend.h>
#pragma GCC diagnostic pop
#endif

#ifndef MOP_CUDNN_CHECK
#define MOP_CUDNN_CHECK(call)                                                                      \
  do {                                                                                             \
    cudnnStatus_t mop_st_ = (call);                                                                \
    if (mop_st_ != CUDNN_STATUS_SUCCESS) [[unlikely]]                                              \
      ::mop::detail::fail("cuDNN error", #call, __FILE__, __LINE__, cudnnGetErrorString(mop_st_)); \
  } while (0)
#endif

// A cudnn_frontend error_t (code and message) as mop::Error.
#define MOP_CUDNN_FE_CHECK(call)                                                       \
  do {                                                                                 \
    auto mop_fe_ = (call);                                                             \
    if (mop_fe_.is_bad()) [[unlikely]]                                                 \
      ::mop::detail::fail("cuDNN frontend error", #call, __FILE__, __LINE__,           \
                          ::mop::detail::concat(mop_fe_.code, ": ", mop_fe_.err_msg)); \
  } while (0)

namespace mop {

std::string AttentionShape::str() const {
  return detail::concat("B=", batch, " S=", seq, " Nq=", num_q_heads, " Nkv=", num_kv_heads,
                        " D=", head_dim, causal ? " causal" : " full");
}

#ifdef MOP_HAVE_CUDNN_FRONTEND

namespace fe = cudnn_frontend;
using TensorPtr = std::shared_ptr<fe::graph::Tensor_attributes>;

namespace {

// Variant-pack uids of the graph tensors (fixed, so execution needs no lookups by name).
enum Uid : int64_t { kQ = 1, kK, kV, kO, kStats, kDO, kDQ, kDK, kDV, kScale };

// A [T,heads,D] BSHD tensor as cuDNN's [B,H,S,D]: head stride D, token stride heads·D, sequence
// stride S·heads·D. No transposes: cuDNN reads and writes the rows in place.
std::vector<int64_t> bshd_dims(const AttentionShape& s, int64_t heads) {
  return {s.batch, heads, s.seq, s.head_dim};
}
std::vector<int64_t> bshd_strides(const AttentionShape& s, int64_t heads) {
  return {s.seq * heads * s.head_dim, s.head_dim, heads * s.head_dim, 1};
}

TensorPtr bshd_input(fe::graph::Graph& g, const char* name, Uid uid, const AttentionShape& s,
                     int64_t heads) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name(name)
                      .set_uid(uid)
                      .set_dim(bshd_dims(s, heads))
                      .set_stride(bshd_strides(s, heads))
                      .set_data_type(fe::DataType_t::BFLOAT16));
}

void bshd_output(const TensorPtr& t, Uid uid, const AttentionShape& s, int64_t heads) {
  t->set_output(true)
      .set_uid(uid)
      .set_dim(bshd_dims(s, heads))
      .set_stride(bshd_strides(s, heads))
      .set_data_type(fe::DataType_t::BFLOAT16);
}

// lse [B,Nq,S] fp32 is exactly cuDNN's packed-BHSD Stats layout [B,Nq,S,1] (the only layout the
// backward reads correctly before cuDNN 9.26), so Stats is written straight into lse.
std::vector<int64_t> stats_dims(const AttentionShape& s) {
  return {s.batch, s.num_q_heads, s.seq, 1};
}
std::vector<int64_t> stats_strides(const AttentionShape& s) {
  return {s.num_q_heads * s.seq, s.seq, 1, 1};
}

// The softmax scale, read from a host float at each execution.
TensorPtr scale_input(fe::graph::Graph& g) {
  return g.tensor(fe::graph::Tensor_attributes()
                      .set_name("attn_scale")
                      .set_uid(kScale)
                      .set_dim({1, 1, 1, 1})
                      .set_stride({1, 1, 1, 1})
                      .set_is_pass_by_value(true)
                      .set_data_type(fe::DataType_t::FLOAT));
}

std::unique_ptr<fe::graph::Graph> new_graph() {
  auto g = std::make_unique<fe::graph::Graph>();
  // bf16 I/O; scores, softmax and accumulation in fp32.
  g->set_io_data_type(fe::DataType_t::BFLOAT16)
      .set_intermediate_data_type(fe::DataType_t::FLOAT)
      .set_compute_data_type(fe::DataType_t::FLOAT);
  return g;
}

// Causal within each sequence: query s sees keys j ≤ s (top-left aligned diagonal, right bound 0;
// with S_q = S_kv that is the usual lower triangle). Full attention (shape.causal false) sets no
// mask at all.
template <class Attributes>
void set_causal(Attributes& a) {
  a.set_diagonal_alignment(fe::DiagonalAlignment_t::TOP_LEFT).set_diagonal_band_right_bound(0);
}

std::unique_ptr<fe::graph::Graph> forward_graph(const AttentionShape& s) {
  auto g = new_graph();
  TensorPtr q = bshd_input(*g, "q", kQ, s, s.num_q_heads);
  TensorPtr k = bshd_input(*g, "k", kK, s, s.num_kv_heads);
  TensorPtr v = bshd_input(*g, "v", kV, s, s.num_kv_heads);
  auto attrs = fe::graph::SDPA_attributes()
                   .set_name("attention_fwd")
                   .set_generate_stats(true)
                   .set_attn_scale(scale_input(*g));
  if (s.causal) set_causal(attrs);
  auto [o, stats] = g->sdpa(q, k, v, std::move(attrs));
  bshd_output(o, kO, s, s.num_q_heads);
  stats->set_output(true)
      .set_uid(kStats)
      .set_dim(stats_dims(s))
      .set_stride(stats_strides(s))
      .set_data_type(fe::DataType_t::FLOAT);
  return g;
}

// Backward determinism. By default cuDNN's backward adds each key block's dQ contribution into an
// fp32 workspace (dQ_accum, B·Nq·S·D·4 bytes) with atomics, so dq may differ in the last bits from
// run to run (whether the GQA head sums of dk/dv are ordered is cuDNN's business; the test
// reports it). The deterministic variant on Hopper (cuDNN < 9.25) instead stores dP for every
// (b, h, i, j) in the workspace — about B·Nq·S²·2 bytes: 1 GiB at B=1, Nq=32, S=4096, 16 GiB at
// S=16384 — and forms dQ with a separate GEMM. Too costly as the default; opt in per CudaBackend.
std::unique_ptr<fe::graph::Graph> backward_graph(const AttentionShape& s, bool deterministic) {
  auto g = new_graph();
  TensorPtr q = bshd_input(*g, "q", kQ, s, s.num_q_heads);
  TensorPtr k = bshd_input(*g, "k", kK, s, s.num_kv_heads);
  TensorPtr v = bshd_input(*g, "v", kV, s, s.num_kv_heads);
  TensorPtr o = bshd_input(*g, "o", kO, s, s.num_q_heads);
  TensorPtr dout = bshd_input(*g, "dout", kDO, s, s.num_q_heads);
  TensorPtr stats = g->tensor(fe::graph::Tensor_attributes()
                                  .set_name("stats")
                                  .set_uid(kStats)
                                  .set_dim(stats_dims(s))
                                  .set_stride(stats_strides(s))
                                  .set_data_type(fe::DataType_t::FLOAT));
  auto attrs = fe::graph::SDPA_backward_attributes()
                   .set_name("attention_bwd")
                   .set_attn_scale(scale_input(*g))
                   .set_deterministic_algorithm(deterministic);
  if (s.causal) set_causal(attrs);
  auto [dq, dk, dv] = g->sdpa_backward(q, k, v, o, dout, stats, std::move(attrs));
  bshd_output(dq, kDQ, s, s.num_q_heads);
  bshd_output(dk, kDK, s, s.num_kv_heads);
  bshd_output(dv, kDV, s, s.num_kv_heads);
  return g;
}

// One build step. cuDNN's "not supported" answers (at validation, or no engine passing the support
// check) are about the user's shape; anything else is a bug or a broken installation.
void build_step(fe::error_t e, const char* step, const char* pass, const AttentionShape& s) {
  if (e.is_good()) return;
  if (e.code == fe::error_code_t::GRAPH_NOT_SUPPORTED ||
      e.code == fe::error_code_t::GRAPH_EXECUTION_PLAN_CREATION_FAILED)
    throw_user_error("cuDNN flash attention ", pass, " does not support ", s.str(), " (", step,
                     ": ", e.err_msg, ")");
  detail::fail("cuDNN frontend error", step, __FILE__, __LINE__,
               detail::concat(pass, " ", s.str(), ": ", e.code, ": ", e.err_msg));
}

}  // namespace

struct AttentionPlan {
  AttentionPass pass;
  AttentionShape shape;
  std::unique_ptr<fe::graph::Graph> graph;
  int64_t workspace = 0;
  // uid → pointer, refilled before each execution (kept to avoid a map per call).
  std::unordered_map<int64_t, void*> variant_pack;
};

struct CudnnAttention::Impl {
  cudnnHandle_t handle = nullptr;
  // unique_ptr: callers hold AttentionPlan& across later insertions.
  std::vector<std::unique_ptr<AttentionPlan>> plans;
};

CudnnAttention::CudnnAttention(cudaStream_t stream, bool deterministic_bwd)
    : impl_(std::make_unique<Impl>()), deterministic_bwd_(deterministic_bwd) {
  MOP_CUDNN_CHECK(cudnnCreate(&impl_->handle));
  MOP_CUDNN_CHECK(cudnnSetStream(impl_->handle, stream));
}

CudnnAttention::~CudnnAttention() {
  impl_->plans.clear();  // plans before the handle they were built with
  if (impl_->handle) cudnnDestroy(impl_->handle);
}

AttentionPlan& CudnnAttention::plan(AttentionPass pass, const AttentionShape& shape) {
  for (auto& p : impl_->plans)
    if (p->pass == pass && p->shape == shape) return *p;
  const char* name = pass == AttentionPass::Forward ? "forward" : "backward";
  // cuDNN's fused attention needs 16-byte rows of each head (D a multiple of 8 in bf16) and at
  // most 256 (Hopper); say so plainly instead of relaying a backend message.
  MOP_USER_CHECK(
      shape.head_dim % 8 == 0 && shape.head_dim <= 256,
      "cuDNN flash attention needs a head dim that is a multiple of 8 and at most 256; got ",
      shape.str());
  auto p = std::make_unique<AttentionPlan>();
  p->pass = pass;
  p->shape = shape;
  try {
    p->graph = pass == AttentionPass::Forward ? forward_graph(shape)
                                              : backward_graph(shape, deterministic_bwd_);
    fe::graph::Graph& g = *p->graph;
    build_step(g.validate(), "validate", name, shape);
    build_step(g.build_operation_graph(impl_->handle), "build_operation_graph", name, shape);
    build_step(g.create_execution_plans({fe::HeurMode_t::A, fe::HeurMode_t::FALLBACK}),
               "create_execution_plans", name, shape);
    build_step(g.check_support(), "check_support", name, shape);
    build_step(g.build_plans(fe::BuildPlanPolicy_t::HEURISTICS_CHOICE), "build_plans", name, shape);
  } catch (const fe::cudnnException& e) {  // a backend call failed while building
    detail::fail("cuDNN error", "building the attention plan", __FILE__, __LINE__,
                 detail::concat(name, " ", shape.str(), ": ", e.what()));
  } catch (const Error&) {
    throw;
  } catch (const UserError&) {
    throw;
  } catch (const std::runtime_error& e) {
    // sdpa() throws std::runtime_error when no implementation takes the attributes.
    throw_user_error("cuDNN flash attention ", name, " does not support ", shape.str(), " (",
                     e.what(), ")");
  }
  MOP_CUDNN_FE_CHECK(p->graph->get_workspace_size(p->workspace));
  MOP_CHECK(p->workspace >= 0, "negative workspace ", p->workspace);
  impl_->plans.push_back(std::move(p));
  return *impl_->plans.back();
}

size_t CudnnAttention::workspace_bytes(const AttentionPlan& plan) {
  return size_t(plan.workspace);
}

void CudnnAttention::run_fwd(AttentionPlan& plan, const AttentionFwdArgs& a, void* workspace) {
  MOP_CHECK(plan.pass == AttentionPass::Forward, "run_fwd with a backward plan");
  float scale = a.scale;  // read by value during execute()
  auto& vp = plan.variant_pack;
  vp[kQ] = const_cast<void*>(a.q);
  vp[kK] = const_cast<void*>(a.k);
  vp[kV] = const_cast<void*>(a.v);
  vp[kO] = a.out;
  vp[kStats] = a.lse;
  vp[kScale] = &scale;
  MOP_CUDNN_FE_CHECK(plan.graph->execute(impl_->handle, vp, workspace));
}

void CudnnAttention::run_bwd(AttentionPlan& plan, const AttentionBwdArgs& a, void* workspace) {
  MOP_CHECK(plan.pass == AttentionPass::Backward, "run_bwd with a forward plan");
  float scale = a.scale;
  auto& vp = plan.variant_pack;
  vp[kQ] = const_cast<void*>(a.q);
  vp[kK] = const_cast<void*>(a.k);
  vp[kV] = const_cast<void*>(a.v);
  vp[kO] = const_cast<void*>(a.out);
  vp[kDO] = const_cast<void*>(a.dout);
  vp[kStats] = const_cast<float*>(a.lse);
  vp[kDQ] = a.dq;
  vp[kDK] = a.dk;
  vp[kDV] = a.dv;
  vp[kScale] = &scale;
  MOP_CUDNN_FE_CHECK(plan.graph->execute(impl_->handle, vp, workspace));
}

#else  // no cuDNN frontend headers at build time

struct AttentionPlan {
  int64_t workspace = 0;
};
struct CudnnAttention::Impl {};

CudnnAttention::CudnnAttention(cudaStream_t, bool deterministic_bwd)
    : deterministic_bwd_(deterministic_bwd) {}
CudnnAttention::~CudnnAttention() = default;

AttentionPlan& CudnnAttention::plan(AttentionPass, const AttentionShape&) {
  throw_user_error(
      "attention on the GPU needs the cuDNN frontend headers (third_party/cudnn_frontend/include, "
      "see scripts/setup.sh); this binary was built without them");
}
size_t CudnnAttention::workspace_bytes(const AttentionPlan& plan) {
  return size_t(plan.workspace);
}
void CudnnAttention::run_fwd(AttentionPlan&, const AttentionFwdArgs&, void*) {
  MOP_UNREACHABLE("no cuDNN frontend");
}
void CudnnAttention::run_bwd(AttentionPlan&, const AttentionBwdArgs&, void*) {
  MOP_UNREACHABLE("no cuDNN frontend");
}

#endif  // MOP_HAVE_CUDNN_FRONTEND

}  // namespace mop
