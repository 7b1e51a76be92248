// CUDA backend, elementwise stem: fill, device dtype conversion (copy's device-to-device half;
// backend.cpp has the rest), add, sum/sumsq (kernels/elementwise.cu); and the pointwise family's
// state (pointwise.h): its creation, preparation and size.
#include <algorithm>
#include <memory>

#include "kernels/elementwise.cuh"
#include "kernels/rmsnorm.cuh"
#include "kernels/rope.cuh"
#include "ops/cuda/backend.h"
#include "ops/cuda/pointwise.h"
#include "runtime/cuda_check.h"

namespace mop {

void PointwiseStateDeleter::operator()(PointwiseState* s) const {
  delete s;
}

namespace {
bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
  const char *pa = static_cast<const char*>(a), *pb = static_cast<const char*>(b);
  return pa < pb + b_bytes && pb < pa + a_bytes;
}
}  // namespace

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


PointwiseState& CudaBackend::pointwise_state() {
  if (pointwise_) return *pointwise_;
  pointwise_.reset(new PointwiseState);
  PointwiseState& s = *pointwise_;
  const size_t table_bytes = size_t(kRopeSlots) * kernels::kRopeMaxHalfDim * sizeof(float);
  s.reduce_partials = Buffer(MemKind::Device, kernels::kReduceMaxBlocks * 4 * sizeof(uint64_t));
  s.rope_device = Buffer(MemKind::Device, table_bytes);
  s.rope_host = Buffer(MemKind::Pinned, table_bytes);
  s.id_error = Buffer(MemKind::Pinned, sizeof(int));
  // With unified addressing (every 64-bit process) memory from cudaHostAlloc is mapped into the
  // device's address space at the same pointer value.
  s.id_error_device = static_cast<int*>(s.id_error.data());
  MOP_CUDA_CHECK(cudaStreamSynchronize(cudaStreamLegacy));  // see reserve()
  return s;
}

// ---- preparation ------------------------------------------------------------------------------

void CudaBackend::prepare_pointwise(const OpShapes& shapes) {
  PointwiseState& s = pointwise_state();
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

size_t CudaBackend::pointwise_workspace_bytes() const {
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

void CudaBackend::fill(Tensor x, double value) {
  // The element's bit pattern is the CPU reference's fill of one element: the same conversion
  // (one nearest-even rounding to bf16, also from f64) and the same integer check for i32.
  static const std::unique_ptr<Ops> host = make_cpu_ops();
  uint64_t bits = 0;
  host->fill(Tensor(&bits, x.dtype, {1}), value);
  kernels::fill(x.data, bits, dtype_size(x.dtype), x.numel(), stream_);
}

void CudaBackend::convert_device(void* dst, DType dst_dtype, const void* src, DType src_dtype,
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

void CudaBackend::add(Tensor out, const Tensor& a, const Tensor& b) {
  kernels::add(out.data, a.data, b.data, a.dtype, out.numel(), stream_);
}

void CudaBackend::sumsq(Tensor out, const Tensor& x) {
  PointwiseState& s = pointwise_state();
  kernels::sumsq_exact(out.ptr<int64_t>(), x.data, x.dtype, x.numel(),
                       static_cast<uint64_t*>(s.reduce_partials.data()), stream_);
}

void CudaBackend::sum(Tensor out, const Tensor& x) {
  PointwiseState& s = pointwise_state();
  kernels::reduce_sum(out.data, out.dtype, x.data, x.dtype, x.numel(),
                      static_cast<double*>(s.reduce_partials.data()), stream_);
}

}  // namespace mop
