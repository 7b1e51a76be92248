// The device choice every factory shares (host comms on the CPU, NCCL over a host comm on a GPU)
// and the factory of a lone rank.
#include "parallel/comm_factory.h"

#include "core/error.h"
#include "runtime/nccl_comm.h"

namespace mop {

std::unique_ptr<Comm> CommFactory::data(const MeshGroup& group, Device device, Stream compute) {
  if (device == Device::CPU) return host(group);
  return make_nccl_comm(host(group), compute);
}

std::unique_ptr<Comm> CommFactory::side(const MeshGroup& group, Stream stream, Stream compute) {
  MOP_CHECK(stream.device() == Device::CUDA, "side comms run on a GPU stream");
  return make_nccl_comm(host(group), stream, compute);
}

namespace {

class SelfCommFactory final : public CommFactory {
 public:
  int rank() const override { return 0; }
  std::unique_ptr<Comm> host(const MeshGroup& group) override {
    MOP_CHECK(group.size() == 1, "a ", group.name(), " group of ", group.size(),
              " ranks in a world of one rank");
    return make_self_comm();
  }
};

}  // namespace

std::unique_ptr<CommFactory> make_self_comm_factory() {
  return std::make_unique<SelfCommFactory>();
}

}  // namespace mop
