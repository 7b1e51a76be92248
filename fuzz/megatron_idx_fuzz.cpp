// Fuzz target: a Megatron .idx through MegatronIndex's validation. The input is the size of the
// .bin it goes with (u64 little-endian; missing bytes are 0) followed by the .idx file, which is
// written to an in-memory file (memfd) for MegatronIndex to map. An index it accepts must describe
// arrays that end exactly at the end of the file and sequences that tile the .bin.
#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <string>

#include "data/megatron_format.h"
#include "fuzz/targets.h"

namespace mop {
namespace {

// The memfd every input is written to, named by its /proc/self/fd path.
const std::string& idx_file(std::string_view bytes) {
  static const int fd = ::memfd_create("mop_fuzz_idx", MFD_CLOEXEC);
  static const std::string path = "/proc/self/fd/" + std::to_string(fd);
  MOP_CHECK(fd >= 0, "memfd_create: ", std::strerror(errno));
  MOP_CHECK(::ftruncate(fd, 0) == 0, "ftruncate: ", std::strerror(errno));
  MOP_CHECK(::pwrite(fd, bytes.data(), bytes.size(), 0) == ssize_t(bytes.size()),
            "pwrite: ", std::strerror(errno));
  return path;
}

}  // namespace

void fuzz_megatron_idx(std::string_view bytes) {
  uint64_t bin_bytes = 0;
  const size_t head = bytes.size() < 8 ? bytes.size() : 8;
  for (size_t i = 0; i < head; ++i) bin_bytes |= uint64_t(uint8_t(bytes[i])) << (8 * i);
  const std::string_view idx = bytes.substr(head);
  const MegatronIndex index(idx_file(idx), bin_bytes, "fuzz.bin");

  // The accessors read at offsets derived from the header's counts: those must fit the file
  // exactly, or a read past the end of the mapping is possible.
  const uint64_t num_seq = uint64_t(index.num_sequences()),
                 num_doc = uint64_t(index.num_document_indices());
  MOP_CHECK(kMegatronHeaderBytes + 12 * num_seq + 8 * num_doc == idx.size(), num_seq,
            " sequences and ", num_doc, " document indices in a ", idx.size(), "-byte index");
  const uint64_t item = token_dtype_size(index.dtype());
  uint64_t end = 0;
  for (int64_t i = 0; i < index.num_sequences(); ++i) {
    MOP_CHECK(uint64_t(index.sequence_pointer(i)) == end, "sequence ", i);
    end += uint64_t(index.sequence_length(i)) * item;
  }
  MOP_CHECK(end == bin_bytes && uint64_t(index.num_tokens()) * item == bin_bytes, end, " of ",
            bin_bytes);
  for (int64_t i = 1; i < index.num_document_indices(); ++i)
    MOP_CHECK(index.document_index(i) >= index.document_index(i - 1), "document index ", i);
}

}  // namespace mop

MOP_FUZZ_MAIN(fuzz_megatron_idx)
