// The memory check of generate and score (see forward_memory.h).
#include "cli/forward_memory.h"

#include "core/error.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace mop {

void check_forward_memory(const std::string& what, const ModelDims& dims, const ActivationOptions& options,
                          size_t other, Device device) {
  const ActivationLayout acts = plan_activations(dims, options);
  // On the CPU the device arena and the host mirrors are both host memory.
  const size_t activations = acts.device_bytes() + (device == Device::CPU ? acts.host_bytes() : 0);
  const MemoryInfo mem = memory_info(device);
  const size_t have = device == Device::CPU ? mem.total : mem.free;
  MOP_USER_CHECK(have == 0 || activations + other <= have, what, ": ", options.max_seq,
                 " tokens need ", format_bytes(double(activations)), " of activations and ",
                 format_bytes(double(other)), " for the outputs, but this process may use ",
                 format_bytes(double(have)), " of ", device == Device::CPU ? "host" : "GPU",
                 " memory; use shorter sequences");
}

}  // namespace mop
