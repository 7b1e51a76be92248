// SelfComm (a group of one: every collective is a copy or nothing) and shared Comm helpers.
#include "runtime/comm.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/rng.h"

namespace mop {

bool Comm::all_equal(const std::string& s) {
  // Compare a 52-bit hash (exact in a double) through min and max.
  double h = double(fnv1a64(s) >> 12);
  double v[2] = {h, -h};
  all_reduce_host(v, 2, Op::Max);
  return v[0] == h && -v[1] == h;
}

void Comm::all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                        const std::vector<int64_t>& send_counts) {
  auto starts = [](const std::vector<int64_t>& counts) {
    std::vector<int64_t> at(counts.size(), 0);
    for (size_t r = 1; r < counts.size(); ++r) at[r] = at[r - 1] + counts[r - 1];
    return at;
  };
  all_to_all_v(out, recv_counts, starts(recv_counts), in, send_counts, starts(send_counts));
}

namespace {

int64_t rows_of(const Tensor& t) { return t.ndim ? t.shape[0] : 1; }

// Bytes per row from the shape, also for a tensor of zero rows (where row_numel() reads 0).
size_t row_bytes_of(const Tensor& t) {
  int64_t n = 1;
  for (int d = 1; d < t.ndim; ++d) n *= t.shape[d];
  return size_t(n) * dtype_size(t.dtype);
}

}  // namespace

size_t Comm::check_all_to_all(const Tensor& out, const std::vector<int64_t>& recv_counts,
                              const std::vector<int64_t>& recv_offsets, const Tensor& in,
                              const std::vector<int64_t>& send_counts,
                              const std::vector<int64_t>& send_offsets) const {
  const size_t n = size_t(size());
  MOP_CHECK(recv_counts.size() == n && recv_offsets.size() == n && send_counts.size() == n &&
                send_offsets.size() == n,
            "all_to_all_v needs one count and one offset per rank (", n, " ranks)");
  const size_t row_bytes = row_bytes_of(in);
  MOP_CHECK(row_bytes_of(out) == row_bytes, "all_to_all_v row widths differ: in ", in.shape_str(),
            " ", dtype_name(in.dtype), ", out ", out.shape_str(), " ", dtype_name(out.dtype));
  std::vector<std::pair<int64_t, int64_t>> received;
  for (size_t r = 0; r < n; ++r) {
    MOP_CHECK(send_counts[r] >= 0 && recv_counts[r] >= 0 && send_offsets[r] >= 0 &&
                  recv_offsets[r] >= 0,
              "all_to_all_v: negative count or offset for rank ", r);
    MOP_CHECK(send_offsets[r] + send_counts[r] <= rows_of(in) &&
                  recv_offsets[r] + recv_counts[r] <= rows_of(out),
              "all_to_all_v spans exceed the buffers at rank ", r, ": send rows [", send_offsets[r],
              ", ", send_offsets[r] + send_counts[r], ") of ", rows_of(in), ", receive rows [",
              recv_offsets[r], ", ", recv_offsets[r] + recv_counts[r], ") of ", rows_of(out));
    if (recv_counts[r]) received.emplace_back(recv_offsets[r], recv_offsets[r] + recv_counts[r]);
  }
  std::sort(received.begin(), received.end());
  for (size_t i = 1; i < received.size(); ++i)
    MOP_CHECK(received[i].first >= received[i - 1].second, "all_to_all_v: received spans overlap");
  return row_bytes;
}

void Comm::send(const Tensor&, int, int) {
  MOP_CHECK(false, name(), " comm has no point-to-point messages (send)");
}

void Comm::recv(Tensor, int, int) {
  MOP_CHECK(false, name(), " comm has no point-to-point messages (recv)");
}

Comm::MessageHeader Comm::message_header(const Tensor& t, int tag) {
  MessageHeader h;
  h.tag = tag, h.bytes = int64_t(t.bytes());
  h.dtype = int32_t(t.dtype), h.ndim = t.ndim;
  for (int d = 0; d < t.ndim; ++d) h.shape[d] = t.shape[size_t(d)];
  return h;
}

void Comm::check_message_peer(const char* call, int peer) const {
  MOP_CHECK(peer >= 0 && peer < size() && peer != rank(), name(), " ", call, " on rank ", rank(),
            ": peer ", peer, " is not another rank of the group's ", size());
}

namespace {

std::string describe(const Comm::MessageHeader& h) {
  std::string s = "tag " + std::to_string(h.tag) + ", ";
  if (h.dtype >= 0 && h.dtype <= int32_t(DType::U32) && h.ndim >= 0 && h.ndim <= Tensor::kMaxDims) {
    s += dtype_name(DType(h.dtype));
    s += "[";
    for (int d = 0; d < h.ndim; ++d) {
      if (d) s += ',';
      s += std::to_string(h.shape[d]);
    }
    s += "] ";
  }
  return s + "(" + std::to_string(h.bytes) + " bytes)";
}

}  // namespace

void Comm::check_message(const MessageHeader& got, const Tensor& out, int src, int tag) const {
  MOP_CHECK(got.tag == tag && got.bytes == int64_t(out.bytes()), name(), " recv on rank ", rank(),
            " from rank ", src, " expects ", describe(message_header(out, tag)),
            ", but the oldest message from rank ", src, " is ", describe(got),
            ": the sends and receives of the schedule do not pair up");
}

namespace {

class SelfComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "self"; }
  void all_reduce_sum(Tensor) override {}
  void all_gather(Tensor out, const Tensor& in) override { copy_bytes(out, in); }
  void reduce_scatter_sum(Tensor out, const Tensor& in) override { copy_bytes(out, in); }
  using Comm::all_to_all_v;
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts,
                    const std::vector<int64_t>& recv_offsets, const Tensor& in,
                    const std::vector<int64_t>& send_counts,
                    const std::vector<int64_t>& send_offsets) override {
    size_t row_bytes =
        check_all_to_all(out, recv_counts, recv_offsets, in, send_counts, send_offsets);
    MOP_CHECK(recv_counts[0] == send_counts[0], "self all_to_all_v counts");
    MOP_CHECK(in.device == Device::CPU, "SelfComm moves host buffers only");
    const char* src = static_cast<const char*>(in.data) + size_t(send_offsets[0]) * row_bytes;
    char* dst = static_cast<char*>(out.data) + size_t(recv_offsets[0]) * row_bytes;
    if (send_counts[0] && dst != src) std::memmove(dst, src, size_t(send_counts[0]) * row_bytes);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    MOP_CHECK(src == 0 && dst == 0, "self send_recv between ranks ", src, " and ", dst);
    copy_bytes(out, in);
  }
  // A group of one has no other rank to send to: both refuse (check_message_peer).
  void send(const Tensor&, int dst, int) override { check_message_peer("send", dst); }
  void recv(Tensor, int src, int) override { check_message_peer("recv", src); }
  void broadcast(Tensor, int root) override { MOP_CHECK(root == 0, "root ", root); }
  void barrier() override {}
  void all_reduce_host(double*, int, Op) override {}

 private:
  static void copy_bytes(Tensor out, const Tensor& in) {
    MOP_CHECK(out.bytes() == in.bytes() && in.device == Device::CPU, "self collective sizes");
    if (out.data != in.data) std::memcpy(out.data, in.data, in.bytes());
  }
};

}  // namespace

std::unique_ptr<Comm> make_self_comm() { return std::make_unique<SelfComm>(); }

}  // namespace mop
