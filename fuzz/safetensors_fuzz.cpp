// Fuzz target: a .safetensors file image through parse_safetensors, the validation every
// SafetensorsFile makes before it hands out pointers. Every byte of every tensor it accepts is then
// read, so a tensor reaching outside the input is an AddressSanitizer report.
#include "ckpt/safetensors.h"
#include "fuzz/targets.h"

namespace mop {

void fuzz_safetensors(std::string_view bytes) {
  SafetensorsTensors tensors;
  SafetensorsMetadata metadata;
  parse_safetensors(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size(),
                    "fuzz.safetensors", tensors, metadata);
  uint64_t total = 0;
  uint8_t mix = 0;
  for (const auto& [name, t] : tensors) {
    MOP_CHECK(uint64_t(t.numel()) * dtype_size(t.dtype) == t.bytes, name);
    const auto* p = static_cast<const uint8_t*>(t.data);
    for (uint64_t i = 0; i < t.bytes; ++i) mix ^= p[i];
    total += t.bytes;
  }
  MOP_CHECK(total <= bytes.size(), "tensors hold ", total, " bytes of a ", bytes.size(),
            "-byte file");
  volatile uint8_t sink = mix;
  (void)sink;
}

}  // namespace mop

MOP_FUZZ_MAIN(fuzz_safetensors)
