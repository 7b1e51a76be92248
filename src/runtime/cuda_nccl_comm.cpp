// NCCL collectives on device tensors, enqueued on the backend's stream; the communicator is
// bootstrapped through a host comm of the same group (rank 0's id broadcast to the group).
// Variable all-to-all is one NCCL group of send/recv pairs with byte counts, so rows of any dtype
// move unchanged.
#include "runtime/nccl_comm.h"

#include <exception>
#include <string>

#include "runtime/cuda_check.h"
#include "runtime/nccl_check.h"

namespace mop {
namespace {

ncclDataType_t nccl_sum_type(DType t) {
  switch (t) {
    case DType::F32:
      return ncclFloat32;
    case DType::F64:
      return ncclFloat64;
    case DType::BF16:
      return ncclBfloat16;
    case DType::I32:
      return ncclInt32;
    case DType::I64:
      return ncclInt64;
    default:
      break;
  }
  MOP_CHECK(false, "NCCL sum of ", dtype_name(t), " (f32, bf16, f64, i32, i64 only)");
  return ncclFloat32;
}

class NcclComm final : public Comm {
 public:
  NcclComm(Comm& host, cudaStream_t stream, cudaStream_t follow)
      : host_(host), stream_(stream), follow_(follow == stream ? nullptr : follow),
        rank_(host.rank()), size_(host.size()) {
    if (follow_) {
      MOP_CUDA_CHECK(cudaEventCreateWithFlags(&ready_, cudaEventDisableTiming));
      MOP_CUDA_CHECK(cudaEventCreateWithFlags(&done_, cudaEventDisableTiming));
    }
    ncclUniqueId id{};
    if (rank_ == 0) MOP_NCCL_CHECK(ncclGetUniqueId(&id));
    // If rank 0 failed above it throws, and the job's abort path (World::abort) ends the ranks
    // waiting here; a timeout would only add a second message.
    host_.broadcast(Tensor(&id, DType::U8, {int64_t(sizeof id)}), 0);
    MOP_NCCL_CHECK(ncclCommInitRank(&comm_, size_, id, rank_));
  }

  ~NcclComm() override {
    // ncclCommDestroy finalizes first: it flushes the issued work and waits until the
    // communicator is quiescent on every rank. While an exception unwinds or after an asynchronous
    // error the peers may never get there, so the communicator is aborted instead (local, returns
    // at once). Errors here cannot be reported.
    ncclResult_t async = ncclSuccess;
    if (ncclCommGetAsyncError(comm_, &async) != ncclSuccess) async = ncclInternalError;
    if (std::uncaught_exceptions() > 0 || async != ncclSuccess)
      ncclCommAbort(comm_);
    else
      ncclCommDestroy(comm_);
    if (ready_) cudaEventDestroy(ready_);
    if (done_) cudaEventDestroy(done_);
  }
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }

  void all_reduce_sum(Tensor x) override {
    device(x);
    ncclDataType_t type = nccl_sum_type(x.dtype);
    if (x.numel() == 0) return;  // same size on every rank, so every rank skips
    begin();
    MOP_NCCL_CHECK(ncclAllReduce(x.data, x.data, size_t(x.numel()), type, ncclSum, comm_, stream_));
    end();
  }

  void all_gather(Tensor out, const Tensor& in) override {
    device(out), device(in);
    MOP_CHECK(out.bytes() == in.bytes() * size_t(size_) && out.dtype == in.dtype,
              "all_gather sizes: out ", out.shape_str(), ", in ", in.shape_str(), " × ", size_);
    if (in.bytes() == 0) return;
    begin();
    MOP_NCCL_CHECK(ncclAllGather(in.data, out.data, in.bytes(), ncclUint8, comm_, stream_));
    end();
  }

  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    device(out), device(in);
    MOP_CHECK(in.numel() == out.numel() * size_ && out.dtype == in.dtype,
              "reduce_scatter sizes: out ", out.shape_str(), " × ", size_, ", in ", in.shape_str());
    ncclDataType_t type = nccl_sum_type(in.dtype);
    if (out.numel() == 0) return;
    begin();
    MOP_NCCL_CHECK(
        ncclReduceScatter(in.data, out.data, size_t(out.numel()), type, ncclSum, comm_, stream_));
    end();
  }

  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    device(out), device(in);
    // Rows move as bytes: any dtype, the same width on both sides.
    const size_t row_bytes =
        check_all_to_all(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
    // Sends and receives of one group run concurrently: an aliased buffer would be overwritten
    // while it is still being read.
    int64_t num_send = 0, num_recv = 0;
    for (int r = 0; r < size_; ++r) num_send += send_counts[r], num_recv += recv_counts[r];
    MOP_CHECK(num_send == 0 || num_recv == 0 || in.data != out.data,
              "all_to_all_v cannot run in place");
    const char* src = static_cast<const char*>(in.data);
    char* dst = static_cast<char*>(out.data);
    begin();
    // Every pair, this rank's own included (NCCL copies to self inside the group), so one rank
    // runs the same path as many. Peers with zero rows are skipped on both sides, which is
    // consistent because the counts agree (rank s's send_counts[d] is rank d's recv_counts[s]).
    ncclResult_t first_send_recv_error = ncclSuccess;
    MOP_NCCL_CHECK(ncclGroupStart());
    for (int r = 0; r < size_ && first_send_recv_error == ncclSuccess; ++r) {
      size_t send_bytes = size_t(send_counts[r]) * row_bytes;
      size_t recv_bytes = size_t(recv_counts[r]) * row_bytes;
      if (send_bytes)
        first_send_recv_error = ncclSend(src + size_t(send_offsets[r]) * row_bytes, send_bytes,
                                         ncclUint8, r, comm_, stream_);
      if (recv_bytes && first_send_recv_error == ncclSuccess)
        first_send_recv_error = ncclRecv(dst + size_t(recv_offsets[r]) * row_bytes, recv_bytes,
                                         ncclUint8, r, comm_, stream_);
    }
    // The group is closed even when an enqueue failed, so NCCL's group depth stays balanced.
    ncclResult_t group_end = ncclGroupEnd();
    MOP_NCCL_CHECK(first_send_recv_error);
    MOP_NCCL_CHECK(group_end);
    end();
  }

  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    device(out), device(in);
    MOP_CHECK(out.bytes() == in.bytes(), "send_recv sizes: out ", out.shape_str(), ", in ", in.shape_str());
    MOP_CHECK(src >= 0 && src < size_ && dst >= 0 && dst < size_, "send_recv peers ", src, ", ", dst,
              " of ", size_, " ranks");
    MOP_CHECK(in.bytes() == 0 || in.data != out.data, "send_recv cannot run in place");
    if (in.bytes() == 0) return;
    begin();
    ncclResult_t first = ncclSuccess;
    MOP_NCCL_CHECK(ncclGroupStart());
    first = ncclSend(in.data, in.bytes(), ncclUint8, dst, comm_, stream_);
    if (first == ncclSuccess) first = ncclRecv(out.data, out.bytes(), ncclUint8, src, comm_, stream_);
    ncclResult_t group_end = ncclGroupEnd();
    MOP_NCCL_CHECK(first);
    MOP_NCCL_CHECK(group_end);
    end();
  }

  void broadcast(Tensor x, int root) override {
    device(x);
    MOP_CHECK(root >= 0 && root < size_, "broadcast root ", root, " of ", size_, " ranks");
    if (x.bytes() == 0) return;
    begin();
    MOP_NCCL_CHECK(ncclBroadcast(x.data, x.data, x.bytes(), ncclUint8, root, comm_, stream_));
    end();
  }

  void barrier() override {
    // Device work first: a barrier means "everything issued before it is done on every rank".
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream_));
    ncclResult_t async = ncclSuccess;
    MOP_NCCL_CHECK(ncclCommGetAsyncError(comm_, &async));
    MOP_NCCL_CHECK(async);
    host_.barrier();
  }

  void join() override {
    if (follow_) MOP_CUDA_CHECK(cudaStreamWaitEvent(follow_, done_, 0));
  }

  void all_reduce_host(double* values, int n, Op op) override { host_.all_reduce_host(values, n, op); }

  void keep(std::unique_ptr<Comm> host) { owned_host_ = std::move(host); }

 private:
  static void device(const Tensor& t) {
    MOP_CHECK(t.device == Device::CUDA, "NcclComm moves device buffers only");
  }
  // Asynchronous comms: a collective starts after the work issued so far on the followed stream
  // (its inputs are written there) and marks its end for join().
  void begin() {
    if (!follow_) return;
    MOP_CUDA_CHECK(cudaEventRecord(ready_, follow_));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(stream_, ready_, 0));
  }
  void end() {
    if (follow_) MOP_CUDA_CHECK(cudaEventRecord(done_, stream_));
  }
  Comm& host_;
  std::unique_ptr<Comm> owned_host_;  // when the comm keeps its host comm (make_nccl_comm's overload)
  cudaStream_t stream_;
  cudaStream_t follow_;                          // null: collectives run on the compute stream
  cudaEvent_t ready_ = nullptr, done_ = nullptr;  // asynchronous comms only
  ncclComm_t comm_ = nullptr;
  int rank_, size_;
};

std::unique_ptr<NcclComm> make_nccl(Comm& host, Stream stream, Stream follow) {
  MOP_CHECK(stream.device() == Device::CUDA && !stream.is_null(), "NCCL collectives need a GPU stream");
  return std::make_unique<NcclComm>(host, static_cast<cudaStream_t>(stream.native()),
                                    static_cast<cudaStream_t>(follow.native()));
}

}  // namespace

std::unique_ptr<Comm> make_nccl_comm(Comm& host, Stream stream, Stream follow) {
  return make_nccl(host, stream, follow);
}

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, Stream stream, Stream follow) {
  MOP_CHECK(host, "make_nccl_comm: no host comm");
  std::unique_ptr<NcclComm> comm = make_nccl(*host, stream, follow);
  comm->keep(std::move(host));
  return comm;
}

}  // namespace mop
