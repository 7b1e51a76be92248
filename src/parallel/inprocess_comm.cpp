// In-process collectives: each rank posts pointers to its inputs, the ranks meet, each reads what
// it needs from the others' inputs and writes only its own outputs, and the ranks meet again, so
// no input changes while another rank still reads it. Outputs that may alias the rank's own input
// (the reductions, all_gather) are built aside and written after the second meeting.
// Messages (send/recv) do not meet: a send copies its tensor into the mailbox of its (src, dst)
// pair, a queue in the order sent, and a recv waits for that queue's oldest message.
#include "parallel/inprocess_comm.h"

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <thread>
#include <tuple>

#include "core/error.h"

namespace mop {
namespace {

// What one rank brings to a collective; the others read it between the two meetings.
struct Post {
  const char* what = "";  // the collective: every rank must be in the same one
  const void* in = nullptr;
  size_t bytes = 0;  // of `in` (all_to_all_v: of one row)
  DType dtype = DType::U8;
  int peer = -1;  // send_recv: the destination; broadcast: the root; host: the Op
  const int64_t* send_counts = nullptr;  // all_to_all_v
  const int64_t* send_offsets = nullptr;
};

// One message in flight: its header (what recv checks) and a copy of its bytes.
struct Message {
  Comm::MessageHeader header;
  std::vector<char> bytes;
};

// The messages from one rank to another, oldest first.
struct Mailbox {
  std::mutex mutex;
  std::condition_variable arrived;
  std::deque<Message> queue;
};

// The rendezvous of one comm's ranks.
class Channel {
 public:
  explicit Channel(int size)
      : posts_(size_t(size)),
        mailboxes_(std::make_unique<Mailbox[]>(size_t(size) * size_t(size))) {}
  int size() const { return int(posts_.size()); }

  // The mailbox of messages from rank `src` to rank `dst`.
  Mailbox& mailbox(int src, int dst) {
    return mailboxes_[size_t(src) * size_t(size()) + size_t(dst)];
  }

  // Posts `mine`, meets the others, runs read(posts) (which writes this rank's outputs only),
  // meets them again, then rethrows what `read` threw: a rank that finds a mismatch still lets
  // the others finish.
  template <class Read>
  void exchange(int rank, const Post& mine, Read&& read) {
    posts_[size_t(rank)] = mine;
    meet(mine.what);
    std::exception_ptr error;
    try {
      for (int r = 0; r < size(); ++r)
        MOP_CHECK(std::strcmp(posts_[size_t(r)].what, mine.what) == 0, "in-process ", mine.what,
                  " on rank ", rank, " met ", posts_[size_t(r)].what, " on rank ", r);
      read(posts_);
    } catch (...) {
      error = std::current_exception();
    }
    meet(mine.what);
    if (error) std::rethrow_exception(error);
  }

 private:
  void meet(const char* what) {
    std::unique_lock<std::mutex> lock(mutex_);
    const uint64_t generation = generation_;
    if (++arrived_ == size()) {
      arrived_ = 0, ++generation_;
      wake_.notify_all();
      return;
    }
    const bool met = wake_.wait_for(lock, std::chrono::duration<double>(kInProcessWaitS),
                                    [&] { return generation_ != generation; });
    MOP_CHECK(met, "in-process ", what, ": the other ranks did not arrive within ", kInProcessWaitS,
              " s");
  }

  std::mutex mutex_;
  std::condition_variable wake_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  std::vector<Post> posts_;  // slot r: rank r's, written by rank r before the first meeting
  std::unique_ptr<Mailbox[]> mailboxes_;  // [src · size + dst]
};

// out[i] = ((x0[i] + x1[i]) + x2[i]) + … over the ranks' inputs, from element `first` on.
template <class T>
void sum_in_rank_order(void* out, const std::vector<Post>& all, size_t first, size_t n) {
  T* o = static_cast<T*>(out);
  const T* x0 = static_cast<const T*>(all[0].in) + first;
  std::copy(x0, x0 + n, o);
  for (size_t r = 1; r < all.size(); ++r) {
    const T* x = static_cast<const T*>(all[r].in) + first;
    for (size_t i = 0; i < n; ++i) o[i] += x[i];
  }
}

void sum_in_rank_order(void* out, const std::vector<Post>& all, size_t first, size_t n, DType t) {
  switch (t) {
    case DType::F32:
      return sum_in_rank_order<float>(out, all, first, n);
    case DType::F64:
      return sum_in_rank_order<double>(out, all, first, n);
    case DType::I32:
      return sum_in_rank_order<int32_t>(out, all, first, n);
    case DType::I64:
      return sum_in_rank_order<int64_t>(out, all, first, n);
    default:
      MOP_CHECK(false, "in-process sum of ", dtype_name(t));
  }
}

void check_summable(DType t) {
  MOP_CHECK(t == DType::F32 || t == DType::F64 || t == DType::I32 || t == DType::I64,
            "in-process sum of ", dtype_name(t), " (f32, f64, i32, i64 only, as MPI)");
}

void host(const Tensor& t) {
  MOP_CHECK(t.device == Device::CPU, "in-process comms move host buffers only");
}

// Every rank gave the same number of bytes.
void check_same_bytes(const std::vector<Post>& all, const Post& mine) {
  for (size_t r = 0; r < all.size(); ++r)
    MOP_CHECK(all[r].bytes == mine.bytes && all[r].dtype == mine.dtype, "in-process ", mine.what,
              ": rank ", r, " gave ", all[r].bytes, " bytes of ", dtype_name(all[r].dtype),
              ", this rank ", mine.bytes, " of ", dtype_name(mine.dtype));
}

class InProcessComm final : public Comm {
 public:
  InProcessComm(std::shared_ptr<Channel> channel, int rank)
      : channel_(std::move(channel)), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return channel_->size(); }
  std::string name() const override { return "inprocess"; }

  void all_reduce_sum(Tensor x) override {
    host(x), check_summable(x.dtype);
    std::vector<char> sum(x.bytes());
    const Post mine{"all_reduce_sum", x.data, x.bytes(), x.dtype};
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      check_same_bytes(all, mine);
      sum_in_rank_order(sum.data(), all, 0, size_t(x.numel()), x.dtype);
    });
    if (x.bytes()) std::memcpy(x.data, sum.data(), x.bytes());
  }

  void all_gather(Tensor out, const Tensor& in) override {
    host(out), host(in);
    MOP_CHECK(out.numel() == in.numel() * size() && out.dtype == in.dtype, "all_gather sizes: out ",
              out.shape_str(), ", in ", in.shape_str(), " × ", size());
    std::vector<char> gathered(out.bytes());
    const Post mine{"all_gather", in.data, in.bytes(), in.dtype};
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      check_same_bytes(all, mine);
      for (size_t r = 0; r < all.size(); ++r)
        if (mine.bytes) std::memcpy(gathered.data() + r * mine.bytes, all[r].in, mine.bytes);
    });
    if (out.bytes()) std::memcpy(out.data, gathered.data(), out.bytes());
  }

  void reduce_scatter_sum(Tensor out, const Tensor& in) override {
    host(out), host(in), check_summable(in.dtype);
    MOP_CHECK(in.numel() == out.numel() * size() && out.dtype == in.dtype,
              "reduce_scatter sizes: out ", out.shape_str(), " × ", size(), ", in ",
              in.shape_str());
    std::vector<char> sum(out.bytes());
    const Post mine{"reduce_scatter_sum", in.data, in.bytes(), in.dtype};
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      check_same_bytes(all, mine);
      sum_in_rank_order(sum.data(), all, size_t(rank_ * out.numel()), size_t(out.numel()),
                        in.dtype);
    });
    if (out.bytes()) std::memcpy(out.data, sum.data(), out.bytes());
  }

  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    host(out), host(in);
    const size_t row_bytes =
        check_all_to_all(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
    // Other ranks read `in` while this one writes `out`.
    MOP_CHECK(in.data != out.data || in.bytes() == 0, "all_to_all_v cannot run in place");
    Post mine{"all_to_all_v", in.data, row_bytes};
    mine.send_counts = send_counts.data(), mine.send_offsets = send_offsets.data();
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      check_same_bytes(all, mine);
      for (size_t s = 0; s < all.size(); ++s) {
        const int64_t rows = all[s].send_counts[rank_];
        MOP_CHECK(rows == recv_counts[s], "all_to_all_v: rank ", s, " sends ", rows,
                  " rows to rank ", rank_, ", which expects ", recv_counts[s]);
        const char* src =
            static_cast<const char*>(all[s].in) + size_t(all[s].send_offsets[rank_]) * row_bytes;
        if (rows)
          std::memcpy(static_cast<char*>(out.data) + size_t(recv_offsets[s]) * row_bytes, src,
                      size_t(rows) * row_bytes);
      }
    });
  }

  // Every rank of the group calls it at once (a ring step), as everywhere in the trainer.
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    host(out), host(in);
    MOP_CHECK(out.bytes() == in.bytes(), "send_recv sizes: out ", out.shape_str(), ", in ",
              in.shape_str());
    MOP_CHECK(src >= 0 && src < size() && dst >= 0 && dst < size(), "send_recv peers ", src, ", ",
              dst, " of ", size(), " ranks");
    MOP_CHECK(in.bytes() == 0 || in.data != out.data, "send_recv cannot run in place");
    Post mine{"send_recv", in.data, in.bytes()};
    mine.peer = dst;
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      const Post& from = all[size_t(src)];
      MOP_CHECK(from.peer == rank_, "send_recv: rank ", rank_, " receives from rank ", src,
                ", which sends to rank ", from.peer);
      MOP_CHECK(from.bytes == out.bytes(), "send_recv: rank ", src, " sends ", from.bytes,
                " bytes, rank ", rank_, " receives ", out.bytes());
      if (from.bytes) std::memcpy(out.data, from.in, from.bytes);
    });
  }

  void send(const Tensor& in, int dst, int tag) override {
    host(in), check_message_peer("send", dst);
    Message m{message_header(in, tag), std::vector<char>(in.bytes())};
    if (in.bytes()) std::memcpy(m.bytes.data(), in.data, in.bytes());
    Mailbox& box = channel_->mailbox(rank_, dst);
    {
      std::lock_guard<std::mutex> lock(box.mutex);
      box.queue.push_back(std::move(m));
    }
    box.arrived.notify_all();
  }

  void recv(Tensor out, int src, int tag) override {
    host(out), check_message_peer("recv", src);
    Mailbox& box = channel_->mailbox(src, rank_);
    Message m;
    {
      std::unique_lock<std::mutex> lock(box.mutex);
      const bool arrived = box.arrived.wait_for(
          lock, std::chrono::duration<double>(kInProcessWaitS), [&] { return !box.queue.empty(); });
      MOP_CHECK(arrived, "in-process recv on rank ", rank_, ": no message from rank ", src,
                " within ", kInProcessWaitS, " s");
      m = std::move(box.queue.front());
      box.queue.pop_front();
    }
    check_message(m.header, out, src, tag);
    if (out.bytes()) std::memcpy(out.data, m.bytes.data(), out.bytes());
  }

  void broadcast(Tensor x, int root) override {
    host(x);
    MOP_CHECK(root >= 0 && root < size(), "broadcast root ", root, " of ", size(), " ranks");
    Post mine{"broadcast", x.data, x.bytes()};
    mine.peer = root;
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      for (size_t r = 0; r < all.size(); ++r)
        MOP_CHECK(all[r].peer == root && all[r].bytes == mine.bytes, "broadcast: rank ", r,
                  " gave root ", all[r].peer, " and ", all[r].bytes, " bytes, rank ", rank_,
                  " root ", root, " and ", mine.bytes);
      if (rank_ != root && mine.bytes) std::memcpy(x.data, all[size_t(root)].in, mine.bytes);
    });
  }

  void barrier() override {
    channel_->exchange(rank_, Post{"barrier"}, [](const std::vector<Post>&) {});
  }

  void all_reduce_host(double* values, int n, Op op) override {
    std::vector<double> result(static_cast<size_t>(n));
    Post mine{"all_reduce_host", values, size_t(n) * sizeof(double), DType::F64};
    mine.peer = int(op);
    channel_->exchange(rank_, mine, [&](const std::vector<Post>& all) {
      check_same_bytes(all, mine);
      for (size_t r = 0; r < all.size(); ++r)
        MOP_CHECK(all[r].peer == mine.peer, "all_reduce_host: ranks ask for different reductions");
      if (op == Op::Sum) return sum_in_rank_order<double>(result.data(), all, 0, size_t(n));
      for (int i = 0; i < n; ++i) {
        double v = static_cast<const double*>(all[0].in)[i];
        for (size_t r = 1; r < all.size(); ++r) {
          const double x = static_cast<const double*>(all[r].in)[i];
          v = op == Op::Max ? (v > x ? v : x) : (v < x ? v : x);
        }
        result[size_t(i)] = v;
      }
    });
    std::copy(result.begin(), result.end(), values);
  }

 private:
  std::shared_ptr<Channel> channel_;
  int rank_;
};

}  // namespace

class InProcessWorld {
 public:
  explicit InProcessWorld(int num_ranks) : num_ranks_(num_ranks) {
    MOP_CHECK(num_ranks >= 1, "an in-process world of ", num_ranks, " ranks");
  }
  int size() const { return num_ranks_; }

  // The rendezvous of the `ordinal`-th comm made for a group along `kind` with members `ranks`.
  std::shared_ptr<Channel> channel(Axes kind, const std::vector<int>& ranks, int ordinal) {
    std::lock_guard<std::mutex> lock(mutex_);
    std::shared_ptr<Channel>& c = channels_[{kind, ranks, ordinal}];
    if (!c) c = std::make_shared<Channel>(int(ranks.size()));
    return c;
  }

 private:
  int num_ranks_;
  std::mutex mutex_;
  std::map<std::tuple<Axes, std::vector<int>, int>, std::shared_ptr<Channel>> channels_;
};

namespace {

class InProcessCommFactory final : public CommFactory {
 public:
  InProcessCommFactory(std::shared_ptr<InProcessWorld> world, int rank)
      : world_(std::move(world)), rank_(rank) {
    MOP_CHECK(rank >= 0 && rank < world_->size(), "rank ", rank, " of an in-process world of ",
              world_->size());
  }
  int rank() const override { return rank_; }
  std::unique_ptr<Comm> host(const MeshGroup& group) override {
    MOP_CHECK(group.index >= 0 && group.index < group.size() && group.world_rank() == rank_,
              "rank ", rank_, " asked for a ", group.name(), " group it is not in");
    for (int r : group.ranks)
      MOP_CHECK(r >= 0 && r < world_->size(), "rank ", r, " outside an in-process world of ",
                world_->size());
    const int ordinal = made_[{group.axes, group.ranks}]++;
    return std::make_unique<InProcessComm>(world_->channel(group.axes, group.ranks, ordinal),
                                           group.index);
  }

 private:
  std::shared_ptr<InProcessWorld> world_;
  int rank_;
  std::map<std::pair<Axes, std::vector<int>>, int> made_;  // comms made so far per group
};

}  // namespace

std::shared_ptr<InProcessWorld> make_inprocess_world(int num_ranks) {
  return std::make_shared<InProcessWorld>(num_ranks);
}

std::unique_ptr<CommFactory> make_inprocess_comm_factory(std::shared_ptr<InProcessWorld> world,
                                                         int rank) {
  return std::make_unique<InProcessCommFactory>(std::move(world), rank);
}

std::vector<std::unique_ptr<Comm>> make_inprocess_comms(int num_ranks) {
  auto world = make_inprocess_world(num_ranks);
  std::vector<std::unique_ptr<Comm>> comms;
  for (int r = 0; r < num_ranks; ++r)
    comms.push_back(make_inprocess_comm_factory(world, r)->host(world_group(num_ranks, r)));
  return comms;
}

void run_inprocess(int num_ranks, const std::function<void(int rank)>& fn) {
  std::vector<std::exception_ptr> errors(static_cast<size_t>(num_ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < num_ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        fn(r);
      } catch (...) {
        errors[size_t(r)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

}  // namespace mop
