// SelfComm (a group of one: every collective is a copy or nothing) and shared Comm helpers.
#include "parallel/comm.h"

#include <cstring>

#include "core/rng.h"

namespace mop {

bool Comm::all_equal(const std::string& s) {
  // Compare a 52-bit hash (exact in a double) through min and max.
  double h = double(fnv1a64(s) >> 12);
  double v[2] = {h, -h};
  all_reduce_host(v, 2, Op::Max);
  return v[0] == h && -v[1] == h;
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
  void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                    const std::vector<int64_t>& send_counts) override {
    MOP_CHECK(recv_counts.size() == 1 && send_counts.size() == 1 && recv_counts[0] == send_counts[0],
              "self all_to_all_v counts");
    size_t bytes = size_t(send_counts[0]) * size_t(in.row_numel()) * dtype_size(in.dtype);
    MOP_CHECK(in.device == Device::CPU, "SelfComm moves host buffers only");
    if (bytes && out.data != in.data) std::memcpy(out.data, in.data, bytes);
  }
  void send_recv(Tensor out, int src, const Tensor& in, int dst) override {
    MOP_CHECK(src == 0 && dst == 0, "self send_recv between ranks ", src, " and ", dst);
    copy_bytes(out, in);
  }
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
