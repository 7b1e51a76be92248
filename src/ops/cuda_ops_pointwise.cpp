// CudaOps, pointwise family: fill, device dtype conversion, add, sum/sumsq, embedding, RMSNorm,
// RoPE, SwiGLU and AdamW (kernels in kernels/elementwise, norm, embedding, adamw). Checks each
// op's tensors as the CPU reference does, then launches on the op stream without synchronising.
// PointwiseState holds the family's device workspaces — reduction partials, RMSNorm dw partials,
// the embedding backward's sort buffers, RoPE inverse-frequency tables, the id-error flag — sized
// by prepare_pointwise from OpShapes, or on first use when an op runs unprepared (tests).
#include <math.h>

#include <algorithm>
#include <cmath>
#include <cstring>

#include "runtime/cuda_check.h"
#include "kernels/adamw.cuh"
#include "kernels/elementwise.cuh"
#include "kernels/embedding.cuh"
#include "kernels/norm.cuh"
#include "ops/cuda_ops.h"

namespace mop {

namespace {
// Distinct (theta, head dim) pairs whose RoPE tables stay cached.
constexpr int kRopeSlots = 8;
}  // namespace

struct PointwiseState {
  Buffer reduce_partials;  // device double [kReduceMaxBlocks]
  Buffer dw_partials;      // device float, rmsnorm_bwd's per-block dw partials
  // embedding_bwd, for up to embed_capacity tokens
  Buffer sort_temp, sorted_ids, sorted_tokens, token_iota, long_runs;
  int64_t embed_capacity = 0;
  // RoPE inv_freq tables: float [kRopeSlots][kRopeMaxHalfDim], pinned host copy and device copy.
  // A slot's pinned half is written once, before its one upload, so no queued copy reads a
  // changing source (reusing a slot waits for the stream first).
  struct RopeSlot {
    uint32_t theta_bits = 0;
    int64_t dim = 0;
    bool used = false;
  };
  Buffer rope_host, rope_device;
  RopeSlot rope_slots[kRopeSlots];
  int rope_next_victim = 0;
  // Set by the embedding kernels when an id lies outside [0, vocab): pinned host memory that the
  // device writes directly (mapped), so checking it needs no synchronisation.
  Buffer id_error;
  int* id_error_device = nullptr;  // the same memory as seen by kernels
};

void PointwiseStateDeleter::operator()(PointwiseState* s) const {
  delete s;
}

namespace {

using bf16_t = __nv_bfloat16;

// Grows `buf` to at least `bytes`. An existing allocation may still be in use by queued work, so
// the stream drains before it is freed; prepared runs never get here (prepare sized everything).
void reserve(Buffer& buf, MemKind kind, size_t bytes, cudaStream_t stream) {
  bytes = std::max<size_t>(bytes, 1);
  if (buf.bytes() >= bytes) return;
  if (buf.data()) MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  buf = Buffer(kind, bytes);
  // Buffer zero-fills device memory with cudaMemset on the legacy default stream, which does not
  // order against the op stream (non-blocking): make sure it is done before a kernel writes here.
  if (kind == MemKind::Device) MOP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));
}

PointwiseState& pointwise_state(std::unique_ptr<PointwiseState, PointwiseStateDeleter>& p) {
  if (p) return *p;
  p.reset(new PointwiseState);
  PointwiseState& s = *p;
  const size_t table_bytes = size_t(kRopeSlots) * kernels::kRopeMaxHalfDim * sizeof(float);
  s.reduce_partials = Buffer(MemKind::Device, kernels::kReduceMaxBlocks * sizeof(double));
  s.rope_device = Buffer(MemKind::Device, table_bytes);
  s.rope_host = Buffer(MemKind::Pinned, table_bytes);
  s.id_error = Buffer(MemKind::Pinned, sizeof(int));
  // With unified addressing (every 64-bit process) memory from cudaHostAlloc is mapped into the
  // device's address space at the same pointer value.
  s.id_error_device = static_cast<int*>(s.id_error.data());
  MOP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // see reserve()
  return s;
}

void reserve_embedding(PointwiseState& s, int64_t tokens, cudaStream_t stream) {
  const size_t sort_bytes = kernels::embedding_bwd_sort_bytes(tokens);
  if (tokens <= s.embed_capacity && sort_bytes <= s.sort_temp.bytes()) return;
  const int64_t capacity = std::max(tokens, s.embed_capacity);
  const size_t index_bytes = size_t(capacity) * sizeof(int32_t);
  reserve(s.sort_temp, MemKind::Device, kernels::embedding_bwd_sort_bytes(capacity), stream);
  reserve(s.sorted_ids, MemKind::Device, index_bytes, stream);
  reserve(s.sorted_tokens, MemKind::Device, index_bytes, stream);
  reserve(s.token_iota, MemKind::Device, index_bytes, stream);
  reserve(s.long_runs, MemKind::Device,
          size_t(kernels::embedding_bwd_long_runs_size(capacity)) * sizeof(int32_t), stream);
  kernels::embedding_iota(static_cast<int32_t*>(s.token_iota.data()), capacity, stream);
  s.embed_capacity = capacity;
}

// The ids of an earlier embedding call, checked on the device, were out of range: report it now
// (an op may not wait for the device, so the error surfaces at the next embedding call).
void check_embedding_ids(PointwiseState& s) {
  volatile int* flag = static_cast<volatile int*>(s.id_error.data());
  if (*flag == 0) return;
  *flag = 0;
  MOP_CHECK(false,
            "embedding: a token id outside [0, vocab) reached an earlier embedding_fwd/bwd "
            "on the device (the data loader should have rejected it)");
}

// Device inv_freq[i] = 1/theta^(2i/dim), computed on the host exactly as the CPU reference does
// (::powf in fp32; the device powf may differ by an ulp), uploaded once per (theta, dim).
const float* rope_inv_freq(PointwiseState& s, float theta, int64_t dim, cudaStream_t stream) {
  uint32_t bits;
  std::memcpy(&bits, &theta, sizeof(bits));
  float* device = static_cast<float*>(s.rope_device.data());
  float* host = static_cast<float*>(s.rope_host.data());
  int slot = -1;
  for (int i = 0; i < kRopeSlots; ++i) {
    const PointwiseState::RopeSlot& r = s.rope_slots[i];
    if (r.used && r.theta_bits == bits && r.dim == dim)
      return device + size_t(i) * kernels::kRopeMaxHalfDim;
    if (!r.used && slot < 0) slot = i;
  }
  if (slot < 0) {  // all slots hold other tables: reuse one once its upload has surely run
    slot = s.rope_next_victim;
    s.rope_next_victim = (s.rope_next_victim + 1) % kRopeSlots;
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
  }
  float* h = host + size_t(slot) * kernels::kRopeMaxHalfDim;
  float* d = device + size_t(slot) * kernels::kRopeMaxHalfDim;
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < half; ++i) h[i] = 1.0f / ::powf(theta, float(2 * i) / float(dim));
  MOP_CUDA_CHECK(
      cudaMemcpyAsync(d, h, size_t(half) * sizeof(float), cudaMemcpyHostToDevice, stream));
  s.rope_slots[slot] = {bits, dim, true};
  return d;
}

// ---- preconditions ------------------------------------------------------------------------------

void expect_device(const Tensor& t, const char* name) {
  MOP_CHECK(t.device == Device::CUDA, name, " is on ", device_name(t.device), ", expected cuda");
  MOP_CHECK(t.data != nullptr || t.numel() == 0, name, " has no data");
}

// On the device, the given dtype and exactly the given shape.
void expect(const Tensor& t, const char* name, DType dtype, std::initializer_list<int64_t> dims) {
  expect_tensor(t, name, Device::CUDA, dtype, dims);
}

bf16_t* bf16_ptr(const Tensor& t) {
  return static_cast<bf16_t*>(t.data);
}

bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}

}  // namespace

// ---- preparation ------------------------------------------------------------------------------

void CudaOps::prepare_pointwise(const OpShapes& shapes) {
  PointwiseState& s = pointwise_state(pointwise_);
  const int64_t tokens = shapes.max_tokens;
  if (tokens <= 0) return;
  reserve_embedding(s, tokens, stream_);
  // rmsnorm_bwd runs over [T, hidden] (layer and final norms) and [T·heads, head_dim] (q/k norms).
  int64_t floats = 0;
  if (shapes.hidden > 0)
    floats = std::max(floats, kernels::rmsnorm_bwd_scratch_floats(tokens, shapes.hidden));
  const int64_t heads = std::max(shapes.heads, shapes.kv_heads);
  if (shapes.head_dim > 0 && heads > 0)
    floats = std::max(floats, kernels::rmsnorm_bwd_scratch_floats(tokens * heads, shapes.head_dim));
  reserve(s.dw_partials, MemKind::Device, size_t(floats) * sizeof(float), stream_);
}

size_t CudaOps::pointwise_workspace_bytes() const {
  if (!pointwise_) return 0;
  const PointwiseState& s = *pointwise_;
  size_t total = 0;
  for (const Buffer* b :
       {&s.reduce_partials, &s.dw_partials, &s.sort_temp, &s.sorted_ids, &s.sorted_tokens,
        &s.token_iota, &s.long_runs, &s.rope_host, &s.rope_device, &s.id_error})
    total += b->bytes();
  return total;
}

// ---- elementwise and memory -------------------------------------------------------------------

void CudaOps::fill(Tensor x, double value) {
  expect_device(x, "fill: x");
  MOP_CHECK(x.dtype == DType::F32 || x.dtype == DType::F64 || x.dtype == DType::BF16 ||
                x.dtype == DType::I32,
            "fill: unsupported dtype ", dtype_name(x.dtype));
  // The element's bit pattern is the CPU reference's fill of one element: the same conversion
  // (one nearest-even rounding to bf16, also from f64) and the same integer check for i32.
  static const std::unique_ptr<Ops> host = make_cpu_ops();
  uint64_t bits = 0;
  host->fill(Tensor(&bits, x.dtype, {1}), value);
  kernels::fill(x.data, bits, dtype_size(x.dtype), x.numel(), stream_);
}

void CudaOps::convert_device(void* dst, DType dst_dtype, const void* src, DType src_dtype,
                             int64_t n) {
  MOP_CHECK(dst_dtype == src_dtype || (dtype_is_float(dst_dtype) && dtype_is_float(src_dtype)),
            "copy: no conversion from ", dtype_name(src_dtype), " to ", dtype_name(dst_dtype));
  MOP_CHECK(
      !overlap(dst, size_t(n) * dtype_size(dst_dtype), src, size_t(n) * dtype_size(src_dtype)) ||
          (dst == src && dst_dtype == src_dtype),
      "copy: source and destination overlap");
  if (dst == src) return;
  kernels::convert(dst, dst_dtype, src, src_dtype, n, stream_);
}

void CudaOps::add(Tensor out, const Tensor& a, const Tensor& b) {
  MOP_CHECK(same_shape(a, b) && same_shape(a, out), "add: shapes ", out.shape_str(), " = ",
            a.shape_str(), " + ", b.shape_str());
  MOP_CHECK(dtype_is_float(a.dtype) && a.dtype == b.dtype && a.dtype == out.dtype, "add: dtypes ",
            dtype_name(out.dtype), " = ", dtype_name(a.dtype), " + ", dtype_name(b.dtype));
  expect_device(out, "add: out");
  expect_device(a, "add: a");
  expect_device(b, "add: b");
  kernels::add(out.data, a.data, b.data, a.dtype, out.numel(), stream_);
}

namespace {
void check_reduce(const Tensor& out, const Tensor& x, const char* op) {
  expect_device(x, op);
  MOP_CHECK(dtype_is_float(x.dtype), op, ": x has dtype ", dtype_name(x.dtype));
  expect_device(out, op);
  MOP_CHECK(out.dtype == DType::F32 || out.dtype == DType::F64, op, ": out has dtype ",
            dtype_name(out.dtype), ", expected f32 or f64");
  MOP_CHECK(out.numel() == 1, op, ": out must hold one element, has ", out.shape_str());
}
}  // namespace

void CudaOps::sumsq(Tensor out, const Tensor& x) {
  check_reduce(out, x, "sumsq");
  PointwiseState& s = pointwise_state(pointwise_);
  kernels::reduce_sum(out.data, out.dtype, x.data, x.dtype, x.numel(), true,
                      static_cast<double*>(s.reduce_partials.data()), stream_);
}

void CudaOps::sum(Tensor out, const Tensor& x) {
  check_reduce(out, x, "sum");
  PointwiseState& s = pointwise_state(pointwise_);
  kernels::reduce_sum(out.data, out.dtype, x.data, x.dtype, x.numel(), false,
                      static_cast<double*>(s.reduce_partials.data()), stream_);
}

// ---- embedding --------------------------------------------------------------------------------

void CudaOps::embedding_fwd(Tensor out, const Tensor& ids, const Tensor& table) {
  MOP_CHECK(table.ndim == 2 && ids.ndim == 1, "embedding_fwd: table ", table.shape_str(), ", ids ",
            ids.shape_str());
  const int64_t vocab = table.shape[0], hidden = table.shape[1], tokens = ids.shape[0];
  expect(ids, "embedding_fwd: ids", DType::I32, {tokens});
  expect(table, "embedding_fwd: table", DType::BF16, {vocab, hidden});
  expect(out, "embedding_fwd: out", DType::BF16, {tokens, hidden});
  PointwiseState& s = pointwise_state(pointwise_);
  check_embedding_ids(s);
  kernels::embedding_fwd(bf16_ptr(out), ids.ptr<int32_t>(), bf16_ptr(table), tokens, vocab, hidden,
                         s.id_error_device, stream_);
}

void CudaOps::embedding_bwd(Tensor dtable, const Tensor& ids, const Tensor& dout) {
  MOP_CHECK(dtable.ndim == 2 && ids.ndim == 1, "embedding_bwd: dtable ", dtable.shape_str(),
            ", ids ", ids.shape_str());
  const int64_t vocab = dtable.shape[0], hidden = dtable.shape[1], tokens = ids.shape[0];
  expect(ids, "embedding_bwd: ids", DType::I32, {tokens});
  expect(dtable, "embedding_bwd: dtable", DType::F32, {vocab, hidden});
  expect(dout, "embedding_bwd: dout", DType::BF16, {tokens, hidden});
  PointwiseState& s = pointwise_state(pointwise_);
  check_embedding_ids(s);
  if (tokens == 0) return;
  reserve_embedding(s, tokens, stream_);
  kernels::EmbeddingBwdWorkspace ws;
  ws.sort_temp = s.sort_temp.data();
  ws.sort_temp_bytes = s.sort_temp.bytes();
  ws.sorted_ids = static_cast<uint32_t*>(s.sorted_ids.data());
  ws.sorted_tokens = static_cast<int32_t*>(s.sorted_tokens.data());
  ws.token_iota = static_cast<const int32_t*>(s.token_iota.data());
  ws.long_runs = static_cast<int32_t*>(s.long_runs.data());
  ws.capacity = s.embed_capacity;
  kernels::embedding_bwd(dtable.ptr<float>(), ids.ptr<int32_t>(), bf16_ptr(dout), tokens, vocab,
                         hidden, ws, s.id_error_device, stream_);
}

// ---- RMSNorm ----------------------------------------------------------------------------------

void CudaOps::rmsnorm_fwd(Tensor y, Tensor rstd, const Tensor& x, const Tensor& w, float eps) {
  MOP_CHECK(x.ndim == 2, "rmsnorm_fwd: x must be [N,C], is ", x.shape_str());
  const int64_t rows = x.shape[0], cols = x.shape[1];
  MOP_CHECK(cols > 0, "rmsnorm_fwd: empty rows");
  expect(x, "rmsnorm_fwd: x", DType::BF16, {rows, cols});
  expect(y, "rmsnorm_fwd: y", DType::BF16, {rows, cols});
  expect(w, "rmsnorm_fwd: w", DType::BF16, {cols});
  expect(rstd, "rmsnorm_fwd: rstd", DType::F32, {rows});
  kernels::rmsnorm_fwd(bf16_ptr(y), rstd.ptr<float>(), bf16_ptr(x), bf16_ptr(w), rows, cols, eps,
                       stream_);
}

void CudaOps::rmsnorm_bwd(Tensor dx, Tensor dw, const Tensor& dy, const Tensor& x, const Tensor& w,
                          const Tensor& rstd, bool accumulate_dx) {
  MOP_CHECK(x.ndim == 2, "rmsnorm_bwd: x must be [N,C], is ", x.shape_str());
  const int64_t rows = x.shape[0], cols = x.shape[1];
  expect(x, "rmsnorm_bwd: x", DType::BF16, {rows, cols});
  expect(dx, "rmsnorm_bwd: dx", DType::BF16, {rows, cols});
  expect(dy, "rmsnorm_bwd: dy", DType::BF16, {rows, cols});
  expect(w, "rmsnorm_bwd: w", DType::BF16, {cols});
  expect(dw, "rmsnorm_bwd: dw", DType::F32, {cols});
  expect(rstd, "rmsnorm_bwd: rstd", DType::F32, {rows});
  if (rows == 0 || cols == 0) return;
  PointwiseState& s = pointwise_state(pointwise_);
  const int64_t floats = kernels::rmsnorm_bwd_scratch_floats(rows, cols);
  reserve(s.dw_partials, MemKind::Device, size_t(floats) * sizeof(float), stream_);
  kernels::rmsnorm_bwd(bf16_ptr(dx), dw.ptr<float>(), bf16_ptr(dy), bf16_ptr(x), bf16_ptr(w),
                       rstd.ptr<float>(), rows, cols, accumulate_dx,
                       static_cast<float*>(s.dw_partials.data()),
                       int64_t(s.dw_partials.bytes() / sizeof(float)), stream_);
}

// ---- RoPE -------------------------------------------------------------------------------------

namespace {
void check_rope(const Tensor& x, const Tensor& pos, float theta, const char* op) {
  MOP_CHECK(x.ndim == 3 && x.shape[2] % 2 == 0, op, ": x must be [T,heads,D] with D even, is ",
            x.shape_str());
  MOP_CHECK(x.shape[2] / 2 <= kernels::kRopeMaxHalfDim, op, ": head dim ", x.shape[2], " exceeds ",
            2 * kernels::kRopeMaxHalfDim);
  expect(x, op, DType::BF16, {x.shape[0], x.shape[1], x.shape[2]});
  expect(pos, "rope: pos", DType::I32, {x.shape[0]});
  MOP_CHECK(theta > 0, op, ": theta = ", theta);
}
}  // namespace

void CudaOps::rope_fwd(Tensor x, const Tensor& pos, float theta) {
  check_rope(x, pos, theta, "rope_fwd");
  if (x.numel() == 0) return;
  PointwiseState& s = pointwise_state(pointwise_);
  const float* inv_freq = rope_inv_freq(s, theta, x.shape[2], stream_);
  kernels::rope(bf16_ptr(x), pos.ptr<int32_t>(), inv_freq, x.shape[0], x.shape[1], x.shape[2],
                false, stream_);
}

void CudaOps::rope_bwd(Tensor dx, const Tensor& pos, float theta) {
  check_rope(dx, pos, theta, "rope_bwd");
  if (dx.numel() == 0) return;
  PointwiseState& s = pointwise_state(pointwise_);
  const float* inv_freq = rope_inv_freq(s, theta, dx.shape[2], stream_);
  kernels::rope(bf16_ptr(dx), pos.ptr<int32_t>(), inv_freq, dx.shape[0], dx.shape[1], dx.shape[2],
                true, stream_);
}

// ---- SwiGLU -----------------------------------------------------------------------------------

void CudaOps::swiglu_fwd(Tensor h, const Tensor& gu) {
  MOP_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0, "swiglu_fwd: gu must be [M,2F], is ",
            gu.shape_str());
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  expect(gu, "swiglu_fwd: gu", DType::BF16, {rows, 2 * width});
  expect(h, "swiglu_fwd: h", DType::BF16, {rows, width});
  MOP_CHECK(!overlap(h.data, h.bytes(), gu.data, gu.bytes()), "swiglu_fwd: h overlaps gu");
  kernels::swiglu_fwd(bf16_ptr(h), bf16_ptr(gu), rows, width, stream_);
}

void CudaOps::swiglu_bwd(Tensor dgu, const Tensor& dh, const Tensor& gu) {
  MOP_CHECK(gu.ndim == 2 && gu.shape[1] % 2 == 0, "swiglu_bwd: gu must be [M,2F], is ",
            gu.shape_str());
  const int64_t rows = gu.shape[0], width = gu.shape[1] / 2;
  expect(gu, "swiglu_bwd: gu", DType::BF16, {rows, 2 * width});
  expect(dh, "swiglu_bwd: dh", DType::BF16, {rows, width});
  expect(dgu, "swiglu_bwd: dgu", DType::BF16, {rows, 2 * width});
  // dgu may be gu itself (each element is read before it is written) but not overlap it otherwise.
  MOP_CHECK(dgu.data == gu.data || !overlap(dgu.data, dgu.bytes(), gu.data, gu.bytes()),
            "swiglu_bwd: dgu partly overlaps gu");
  MOP_CHECK(!overlap(dgu.data, dgu.bytes(), dh.data, dh.bytes()), "swiglu_bwd: dgu overlaps dh");
  kernels::swiglu_bwd(bf16_ptr(dgu), bf16_ptr(dh), bf16_ptr(gu), rows, width, stream_);
}

// ---- AdamW ------------------------------------------------------------------------------------

void CudaOps::adamw_step(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                         const AdamWArgs& args) {
  adamw_step_cast(param, m, v, grad, args, Tensor());
}

void CudaOps::adamw_step_cast(Tensor param, Tensor m, Tensor v, const Tensor& grad,
                              const AdamWArgs& args, Tensor weights) {
  if (weights.data && weights.dtype != DType::BF16) {  // only bf16 compute weights are fused
    adamw_step(param, m, v, grad, args);
    copy(weights, param);
    return;
  }
  if (weights.data) {
    expect_device(weights, "adamw_step_cast: weights");
    MOP_CHECK(weights.numel() == param.numel(), "adamw_step_cast: weights ", weights.shape_str(),
              " vs param ", param.shape_str());
  }
  const int64_t n = param.numel();
  for (const Tensor* t : std::initializer_list<const Tensor*>{&param, &m, &v, &grad}) {
    expect_device(*t, "adamw_step: tensors");
    MOP_CHECK(t->numel() == n, "adamw_step: ", t->shape_str(), " vs param ", param.shape_str());
  }
  MOP_CHECK(param.dtype == DType::F32 && m.dtype == DType::F32 && v.dtype == DType::F32,
            "adamw_step: param, m and v must be f32");
  MOP_CHECK(grad.dtype == DType::F32 || grad.dtype == DType::BF16 || grad.dtype == DType::F64,
            "adamw_step: grad dtype ", dtype_name(grad.dtype));
  MOP_CHECK(args.bias_correction1 > 0 && args.bias_correction2 > 0,
            "adamw_step: bias corrections must be positive (1 − β^step, step ≥ 1)");
  // The per-call constants exactly as cpu_adamw.cpp forms them, in float. lr·wd goes through a
  // volatile so the compiler cannot fuse 1 − lr·wd into one FMA (the reference rounds the product).
  kernels::AdamWConstants c;
  c.beta1 = args.beta1;
  c.beta2 = args.beta2;
  c.eps = args.eps;
  c.grad_scale = args.grad_scale;
  c.one_minus_beta1 = 1.0f - args.beta1;
  c.one_minus_beta2 = 1.0f - args.beta2;
  c.step_size = args.lr / args.bias_correction1;
  c.sqrt_bc2 = std::sqrt(args.bias_correction2);
  volatile float lr_wd = args.lr * args.weight_decay;
  c.decay = 1.0f - lr_wd;
  kernels::adamw_step(param.ptr<float>(), m.ptr<float>(), v.ptr<float>(), grad.data, grad.dtype,
                      static_cast<uint16_t*>(weights.data), n, c, stream_);
}

}  // namespace mop
