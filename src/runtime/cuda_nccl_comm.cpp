// NCCL collectives on device tensors, enqueued on the backend's stream; the communicator is
// bootstrapped through a host comm of the same group (rank 0's id broadcast to the group).
// Variable all-to-all is one NCCL group of send/recv pairs with byte counts, so rows of any dtype
// move unchanged. Messages (send/recv) travel on lanes: one per direction of a pair of ranks, each
// a two-rank NCCL communicator with a stream of its own (see nccl_comm.h for why).
#include "runtime/nccl_comm.h"

#include <algorithm>
#include <exception>
#include <map>
#include <string>
#include <utility>

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

// Host-comm tags of the messages' bookkeeping (the host comm serves this NCCL comm alone).
constexpr int kLaneIdsTag = -2;  // the two NCCL ids of a pair's lanes, lower rank to higher
constexpr int kHeaderTag = -1;   // each message's header, sender to receiver

// A communicator that may have a stuck operation (an exception unwinding, an asynchronous error)
// is aborted, which returns at once; a healthy one is destroyed, which waits until it is quiescent
// on every rank. Errors here cannot be reported.
void close_nccl(ncclComm_t comm) {
  ncclResult_t async = ncclSuccess;
  if (ncclCommGetAsyncError(comm, &async) != ncclSuccess) async = ncclInternalError;
  if (std::uncaught_exceptions() > 0 || async != ncclSuccess)
    ncclCommAbort(comm);
  else
    ncclCommDestroy(comm);
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
    close_nccl(comm_);
    for (auto& [key, lane] : lanes_) {
      close_nccl(lane.comm);
      cudaEventDestroy(lane.done);
      cudaStreamDestroy(lane.stream);
    }
    if (ready_) cudaEventDestroy(ready_);
    if (done_) cudaEventDestroy(done_);
    if (issued_) cudaEventDestroy(issued_);
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

  void send(const Tensor& in, int dst, int tag) override {
    device(in), check_message_peer("send", dst);
    Lane& lane = open_lane(rank_, dst);
    MessageHeader h = message_header(in, tag);
    host_.send(Tensor(&h, DType::U8, {int64_t(sizeof h)}), dst, kHeaderTag);
    if (in.bytes() == 0) return;
    after_compute(lane);
    MOP_NCCL_CHECK(ncclSend(in.data, in.bytes(), ncclUint8, 1, lane.comm, lane.stream));
    issued(lane);
  }

  void recv(Tensor out, int src, int tag) override {
    device(out), check_message_peer("recv", src);
    Lane& lane = open_lane(src, rank_);
    MessageHeader got;
    host_.recv(Tensor(&got, DType::U8, {int64_t(sizeof got)}), src, kHeaderTag);
    // On a mismatch the sender's bytes are never received: its lane stays stuck, and the error
    // ends the job (World::abort), as any internal error does.
    check_message(got, out, src, tag);
    if (out.bytes() == 0) return;
    after_compute(lane);
    MOP_NCCL_CHECK(ncclRecv(out.data, out.bytes(), ncclUint8, 0, lane.comm, lane.stream));
    issued(lane);
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
    check_async(comm_);
    for (auto& [key, lane] : lanes_) {
      MOP_CUDA_CHECK(cudaStreamSynchronize(lane.stream));
      check_async(lane.comm);
    }
    host_.barrier();
  }

  void join() override {
    if (follow_) MOP_CUDA_CHECK(cudaStreamWaitEvent(follow_, done_, 0));
    for (auto& [key, lane] : lanes_)
      if (lane.pending) {
        MOP_CUDA_CHECK(cudaStreamWaitEvent(compute(), lane.done, 0));
        lane.pending = false;
      }
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
  static void check_async(ncclComm_t comm) {
    ncclResult_t async = ncclSuccess;
    MOP_NCCL_CHECK(ncclCommGetAsyncError(comm, &async));
    MOP_NCCL_CHECK(async);
  }

  // One direction of messages between two ranks: a two-rank communicator (the sender is its rank
  // 0), the stream its operations run on, and the end of the last one for join().
  struct Lane {
    ncclComm_t comm = nullptr;
    cudaStream_t stream = nullptr;
    cudaEvent_t done = nullptr;
    bool pending = false;  // issued since the last join()
  };
  // The stream the messages follow: the followed compute stream, or the comm's own when it runs
  // on the compute stream.
  cudaStream_t compute() const { return follow_ ? follow_ : stream_; }

  // The lane from `src` to `dst`, one of them this rank. The first message between two ranks, in
  // either direction, makes both lanes of the pair (lower to higher rank first) on both ranks: a
  // collective of the two, so each waits on the host for the other's first message with it.
  // Making both at once keeps two ranks whose first messages are sends to each other apart from
  // deadlock, as each would wait in its lane's setup for the other's.
  Lane& open_lane(int src, int dst) {
    auto it = lanes_.find({src, dst});
    if (it != lanes_.end()) return it->second;
    const int peer = src == rank_ ? dst : src, lo = std::min(rank_, peer),
              hi = std::max(rank_, peer);
    ncclUniqueId ids[2] = {};
    const Tensor ids_bytes(ids, DType::U8, {int64_t(sizeof ids)});
    if (rank_ == lo) {
      MOP_NCCL_CHECK(ncclGetUniqueId(&ids[0]));
      MOP_NCCL_CHECK(ncclGetUniqueId(&ids[1]));
      host_.send(ids_bytes, hi, kLaneIdsTag);
    } else {
      host_.recv(ids_bytes, lo, kLaneIdsTag);
    }
    const std::pair<int, int> directions[2] = {{lo, hi}, {hi, lo}};
    for (int i = 0; i < 2; ++i) {
      Lane lane;
      MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&lane.stream, cudaStreamNonBlocking));
      MOP_CUDA_CHECK(cudaEventCreateWithFlags(&lane.done, cudaEventDisableTiming));
      const int lane_rank = directions[i].first == rank_ ? 0 : 1;
      const ncclResult_t rc = ncclCommInitRank(&lane.comm, 2, ids[i], lane_rank);
      if (rc != ncclSuccess) {
        cudaEventDestroy(lane.done);
        cudaStreamDestroy(lane.stream);
      }
      MOP_NCCL_CHECK(rc);
      lanes_.emplace(directions[i], lane);
    }
    return lanes_.at({src, dst});
  }
  // A message's operation starts after the compute issued before it: a send's tensor is written
  // there, and a receive's buffer may still be read there.
  void after_compute(Lane& lane) {
    if (!issued_) MOP_CUDA_CHECK(cudaEventCreateWithFlags(&issued_, cudaEventDisableTiming));
    MOP_CUDA_CHECK(cudaEventRecord(issued_, compute()));
    MOP_CUDA_CHECK(cudaStreamWaitEvent(lane.stream, issued_, 0));
  }
  void issued(Lane& lane) {
    MOP_CUDA_CHECK(cudaEventRecord(lane.done, lane.stream));
    lane.pending = true;
  }
  Comm& host_;
  std::unique_ptr<Comm> owned_host_;  // when the comm keeps its host comm (make_nccl_comm's overload)
  cudaStream_t stream_;
  cudaStream_t follow_;                          // null: collectives run on the compute stream
  cudaEvent_t ready_ = nullptr, done_ = nullptr;  // asynchronous comms only
  cudaEvent_t issued_ = nullptr;                  // messages: the compute issued before one
  std::map<std::pair<int, int>, Lane> lanes_;     // by (src, dst)
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
