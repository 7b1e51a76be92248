// MPI collectives on host tensors (large messages are split so every count fits MPI's int), and
// the factory that splits the world into a mesh's groups.
#include "parallel/mpi_comm.h"

#include <algorithm>
#include <climits>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "parallel/mpi_check.h"
#include "parallel/watchdog.h"

namespace mop {
namespace {

MPI_Datatype mpi_type(DType t) {
  switch (t) {
    case DType::F32: return MPI_FLOAT;
    case DType::F64: return MPI_DOUBLE;
    case DType::I32: return MPI_INT32_T;
    case DType::I64: return MPI_INT64_T;
    case DType::U8: return MPI_UINT8_T;
    case DType::U16:
    case DType::BF16: return MPI_UINT16_T;
    case DType::U32: return MPI_UINT32_T;
  }
  return MPI_BYTE;
}

constexpr int64_t kMaxChunk = INT_MAX / 2;  // elements per MPI call
constexpr int kShiftTag = 77;
// Messages of channel c: headers under MPI tag kMessageTag0 + 2c, bytes under the next. MPI
// guarantees tags up to 32767 at least.
constexpr int kMessageTag0 = 1000;
constexpr int kMaxChannels = (32767 - kMessageTag0) / 2;

class MpiComm final : public Comm {
 public:
  MpiComm(MPI_Comm comm, int channel)
      : comm_(comm), header_tag_(kMessageTag0 + 2 * channel), bytes_tag_(header_tag_ + 1) {
    MOP_CHECK(channel >= 0 && channel < kMaxChannels, "MPI comm channel ", channel, " (at most ",
              kMaxChannels, " comms per group)");
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }

  // Sends still in flight are waited for (their peers receive them), except while an exception
  // unwinds or after MPI_Finalize: then they are left to MPI with their buffers, which leak, as
  // a peer that never receives would leave the wait hanging.
  ~MpiComm() override {
    int finalized = 0;
    MPI_Finalized(&finalized);
    if (finalized) {
      for (auto& m : sending_) (void)m.release();
      return;
    }
    const bool unwinding = std::uncaught_exceptions() > 0;
    for (auto& m : sending_) {
      if (!unwinding) {
        MPI_Waitall(int(m->requests.size()), m->requests.data(), MPI_STATUSES_IGNORE);
        continue;
      }
      for (MPI_Request& r : m->requests)
        if (r != MPI_REQUEST_NULL) MPI_Request_free(&r);
      (void)m.release();
    }
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }

  void all_reduce_sum(Tensor x) override {
    host(x);
    MOP_CHECK(x.dtype == DType::F32 || x.dtype == DType::F64 || x.dtype == DType::I32 ||
                  x.dtype == DType::I64,
              "MPI all-reduce of ", dtype_name(x.dtype));
    char* p = static_cast<char*>(x.data);
    for (int64_t done = 0; done < x.numel(); done += kMaxChunk) {
      int n = int(std::min(kMaxChunk, x.numel() - done));
      MOP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, p + done * dtype_size(x.dtype), n, mpi_type(x.dtype),
                                  MPI_SUM, comm_));
    }
  }

  void all_gather(Tensor out, const Tensor& in) override {
    host(out), host(in);
    MOP_CHECK(out.numel() == in.numel() * size_ && out.dtype == in.dtype, "all_gather sizes");
    MOP_CHECK(in.numel() <= INT_MAX, "all_gather message too large");
    MOP_MPI_CHECK(MPI_Allgather(in.data, int(in.numel()), mpi_type(in.dtype), out.data,
                                int(in.numel()), mpi_type(in.dtype), comm_));
  }

  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    host(out), host(in);
    MOP_CHECK(in.numel() == out.numel() * size_ && out.dtype == in.dtype, "reduce_scatter sizes");
    MOP_CHECK(out.numel() <= INT_MAX, "reduce_scatter message too large");
    // The sums of an all-reduce, this rank's part kept: Open MPI's reduce-scatter adds in another
    // order than its all-reduce above 2 ranks, and sliced parameters must sum their gradients
    // exactly as whole ones do (CPU ranks: the traffic does not matter).
    MOP_CHECK(in.numel() <= INT_MAX, "reduce_scatter message too large");
    std::vector<char> sum(in.bytes());
    MOP_MPI_CHECK(MPI_Allreduce(in.data, sum.data(), int(in.numel()), mpi_type(in.dtype), MPI_SUM, comm_));
    if (out.bytes()) std::memcpy(out.data, sum.data() + size_t(rank_) * out.bytes(), out.bytes());
  }

  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    host(out), host(in);
    // Rows are sent as bytes: any dtype.
    const int64_t row_bytes =
        int64_t(check_all_to_all(out, recv_counts, recv_offsets, in, send_counts, send_offsets));
    std::vector<int> sc(size_), sd(size_), rc(size_), rd(size_);
    auto as_int = [&](int64_t rows) {
      MOP_CHECK(rows * row_bytes <= INT_MAX, "all_to_all_v message too large for MPI int counts");
      return int(rows * row_bytes);
    };
    for (int r = 0; r < size_; ++r) {
      sc[r] = as_int(send_counts[r]), sd[r] = as_int(send_offsets[r]);
      rc[r] = as_int(recv_counts[r]), rd[r] = as_int(recv_offsets[r]);
    }
    MOP_MPI_CHECK(MPI_Alltoallv(in.data, sc.data(), sd.data(), MPI_BYTE, out.data, rc.data(),
                                rd.data(), MPI_BYTE, comm_));
  }

  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    host(out), host(in);
    MOP_CHECK(out.bytes() == in.bytes(), "send_recv sizes: out ", out.shape_str(), ", in ", in.shape_str());
    MOP_CHECK(src >= 0 && src < size_ && dst >= 0 && dst < size_, "send_recv peers ", src, ", ", dst,
              " of ", size_, " ranks");
    MOP_CHECK(in.bytes() == 0 || in.data != out.data, "send_recv cannot run in place");
    const char* s = static_cast<const char*>(in.data);
    char* r = static_cast<char*>(out.data);
    for (size_t done = 0; done < in.bytes(); done += size_t(kMaxChunk)) {
      int n = int(std::min<size_t>(size_t(kMaxChunk), in.bytes() - done));
      MOP_MPI_CHECK(MPI_Sendrecv(s + done, n, MPI_BYTE, dst, kShiftTag, r + done, n, MPI_BYTE, src,
                                 kShiftTag, comm_, MPI_STATUS_IGNORE));
    }
  }

  void send(const Tensor& in, int dst, int tag) override {
    host(in), check_message_peer("send", dst);
    reap_sends();
    auto m = std::make_unique<Sending>();
    m->header = message_header(in, tag);
    m->bytes.resize(in.bytes());
    if (in.bytes()) std::memcpy(m->bytes.data(), in.data, in.bytes());
    m->requests.reserve(1 + in.bytes() / size_t(kMaxChunk) + 1);
    auto post = [&](const void* p, size_t n, int mpi_tag) {
      m->requests.push_back(MPI_REQUEST_NULL);
      MOP_MPI_CHECK(MPI_Isend(p, int(n), MPI_BYTE, dst, mpi_tag, comm_, &m->requests.back()));
    };
    post(&m->header, sizeof m->header, header_tag_);
    for (size_t done = 0; done < m->bytes.size(); done += size_t(kMaxChunk))
      post(m->bytes.data() + done, std::min<size_t>(size_t(kMaxChunk), m->bytes.size() - done),
           bytes_tag_);
    sending_.push_back(std::move(m));
  }

  void recv(Tensor out, int src, int tag) override {
    host(out), check_message_peer("recv", src);
    reap_sends();
    MessageHeader got;
    MOP_MPI_CHECK(
        MPI_Recv(&got, int(sizeof got), MPI_BYTE, src, header_tag_, comm_, MPI_STATUS_IGNORE));
    const bool pairs = got.tag == tag && got.bytes == int64_t(out.bytes());
    // A mismatched message's bytes go to a scratch chunk, so the next one pairs up again.
    std::vector<char> scratch(
        pairs ? 0 : size_t(std::min<int64_t>(std::max<int64_t>(got.bytes, 0), kMaxChunk)));
    char* to = static_cast<char*>(out.data);
    for (int64_t done = 0; done < got.bytes; done += kMaxChunk) {
      const int n = int(std::min(kMaxChunk, got.bytes - done));
      MOP_MPI_CHECK(MPI_Recv(pairs ? to + done : scratch.data(), n, MPI_BYTE, src, bytes_tag_,
                             comm_, MPI_STATUS_IGNORE));
    }
    check_message(got, out, src, tag);
  }

  // Nothing to wait for (a send never waits for its receive); frees the sends MPI has finished.
  void join() override { reap_sends(); }

  void broadcast(Tensor x, int root) override {
    host(x);
    MOP_CHECK(x.bytes() <= size_t(INT_MAX), "broadcast message too large");
    MOP_MPI_CHECK(MPI_Bcast(x.data, int(x.bytes()), MPI_BYTE, root, comm_));
  }

  void barrier() override { MOP_MPI_CHECK(MPI_Barrier(comm_)); }

  void all_reduce_host(double* values, int n, Op op) override {
    MPI_Op mop = op == Op::Sum ? MPI_SUM : op == Op::Max ? MPI_MAX : MPI_MIN;
    MOP_MPI_CHECK(MPI_Allreduce(MPI_IN_PLACE, values, n, MPI_DOUBLE, mop, comm_));
  }

 private:
  static void host(const Tensor& t) {
    MOP_CHECK(t.device == Device::CPU, "MpiComm moves host buffers only");
  }
  // A sent message until MPI is done with its header and bytes.
  struct Sending {
    MessageHeader header;
    std::vector<char> bytes;
    std::vector<MPI_Request> requests;
  };
  // Frees the sends MPI has finished, oldest first (later ones usually finish later).
  void reap_sends() {
    while (!sending_.empty()) {
      Sending& m = *sending_.front();
      int done = 0;
      MOP_MPI_CHECK(
          MPI_Testall(int(m.requests.size()), m.requests.data(), &done, MPI_STATUSES_IGNORE));
      if (!done) return;
      sending_.pop_front();
    }
  }
  MPI_Comm comm_;
  int header_tag_, bytes_tag_;  // this comm's channel
  int rank_ = 0, size_ = 1;
  std::deque<std::unique_ptr<Sending>> sending_;
};

class MpiCommFactory final : public CommFactory {
 public:
  MpiCommFactory() { MOP_MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &rank_)); }
  int rank() const override { return rank_; }
  std::unique_ptr<Comm> host(const MeshGroup& group) override {
    MPI_Comm comm = communicator(group);
    return make_mpi_comm(comm, 1 + made_[group.axes]++);
  }
  void share_watchdog(CollectiveWatchdog& dog) override { dog.share_with_peers(); }

 private:
  // One split per set of axes, shared by every comm along them, as MPI_Comm_split is collective
  // over the whole world (so a factory serves one mesh). The first member of each group is its
  // colour (groups of one kind are disjoint), the member's place in it the key, so MPI orders the
  // group as the mesh does.
  MPI_Comm communicator(const MeshGroup& group) {
    MOP_CHECK(group.index >= 0 && group.index < group.size() && group.world_rank() == rank_,
              "rank ", rank_, " asked for a ", group.name(), " group it is not in");
    if (group.axes == kWorldAxes) {
      int size = 0;
      MOP_MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &size));
      MOP_CHECK(size == group.size(), "a world group of ", group.size(), " ranks, MPI has ", size);
      return MPI_COMM_WORLD;
    }
    auto it = splits_.find(group.axes);
    if (it == splits_.end()) {
      MPI_Comm split;
      MOP_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, group.ranks[0], group.index, &split));
      it = splits_.emplace(group.axes, Split{group.ranks, split}).first;
    }
    MOP_CHECK(it->second.ranks == group.ranks, "rank ", rank_, " asked for another ", group.name(),
              " group than the one it split (one mesh per factory)");
    return it->second.comm;
  }
  struct Split {
    std::vector<int> ranks;
    MPI_Comm comm;  // lives as long as the process (the comms refer to it)
  };
  int rank_ = 0;
  std::map<Axes, Split> splits_;
  std::map<Axes, int> made_;  // comms made so far per group: the next one's message channel
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm(MPI_Comm comm, int channel) {
  return std::make_unique<MpiComm>(comm, channel);
}

std::unique_ptr<CommFactory> make_mpi_comm_factory() { return std::make_unique<MpiCommFactory>(); }

}  // namespace mop
