// TensorBoard event files: CRC-32C, TFRecord framing, the few protobuf encodings an Event with a
// scalar summary needs (varint, fixed64, fixed32, length-delimited), and the writer.
#include "train/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cstring>
#include <ctime>
#include <filesystem>

#include "core/error.h"

namespace mop {

namespace {

std::array<uint32_t, 256> make_crc32c_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    t[i] = c;
  }
  return t;
}

void put_le(std::string& out, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; ++i) out.push_back(char((v >> (8 * i)) & 0xff));
}

// Protobuf wire format: key = (field << 3) | wire type; 0 varint, 1 fixed64, 2 length-delimited,
// 5 fixed32.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(char((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(char(v));
}
void put_key(std::string& out, int field, int wire_type) {
  put_varint(out, uint64_t(field) << 3 | wire_type);
}
void put_double(std::string& out, int field, double v) {
  uint64_t bits;
  std::memcpy(&bits, &v, 8);
  put_key(out, field, 1);
  put_le(out, bits, 8);
}
void put_float(std::string& out, int field, float v) {
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  put_key(out, field, 5);
  put_le(out, bits, 4);
}
void put_int64(std::string& out, int field, int64_t v) {
  put_key(out, field, 0);
  put_varint(out, uint64_t(v));  // int64: negatives as 10-byte two's complement varints
}
void put_bytes(std::string& out, int field, std::string_view v) {
  put_key(out, field, 2);
  put_varint(out, v.size());
  out.append(v);
}

}  // namespace

uint32_t crc32c(std::string_view data) {
  static const std::array<uint32_t, 256> table = make_crc32c_table();
  uint32_t c = 0xffffffffu;
  for (unsigned char b : data) c = table[(c ^ b) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(std::string_view data) {
  const uint32_t c = crc32c(data);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord_frame(std::string_view data) {
  std::string len;
  put_le(len, data.size(), 8);
  std::string out = len;
  put_le(out, masked_crc32c(len), 4);
  out.append(data);
  put_le(out, masked_crc32c(data), 4);
  return out;
}

// Event: 1 wall_time (double), 2 step (int64), 3 file_version (string), 5 summary (Summary).
// Summary: repeated 1 value (Value). Value: 1 tag (string), 2 simple_value (float).
std::string event_file_version(double wall_time) {
  std::string e;
  put_double(e, 1, wall_time);
  put_int64(e, 2, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string event_scalar(const std::string& tag, int64_t step, float value, double wall_time) {
  std::string v;
  put_bytes(v, 1, tag);
  put_float(v, 2, value);
  std::string summary;
  put_bytes(summary, 1, v);
  std::string e;
  put_double(e, 1, wall_time);
  put_int64(e, 2, step);
  put_bytes(e, 5, summary);
  return e;
}

// Event field 7 session_log: SessionLog{status (field 1, enum): START = 1}.
std::string event_session_start(int64_t step, double wall_time) {
  std::string log;
  put_int64(log, 1, 1);
  std::string e;
  put_double(e, 1, wall_time);
  put_int64(e, 2, step);
  put_bytes(e, 7, log);
  return e;
}

void TensorBoardWriter::open(const std::string& dir, int64_t resume_step) {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  MOP_USER_CHECK(!ec, "log.tensorboard_dir: cannot create ", dir, ": ", ec.message());
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0 || !host[0]) std::strcpy(host, "localhost");
  const double now = double(std::time(nullptr));
  path_ = (std::filesystem::path(dir) /
           ("events.out.tfevents." + std::to_string(int64_t(now)) + "." + host))
              .string();
  // Append: a run restarted within the same second adds to the file rather than erasing it.
  file_.open(path_, std::ios::binary | std::ios::app);
  MOP_USER_CHECK(file_.good(), "log.tensorboard_dir: cannot write ", path_);
  write(event_file_version(now));
  if (resume_step > 0) write(event_session_start(resume_step + 1, now));
  flush();
}

void TensorBoardWriter::scalar(const std::string& tag, int64_t step, double value,
                               double wall_time) {
  write(event_scalar(tag, step, float(value), wall_time));
}

void TensorBoardWriter::write(const std::string& record) {
  const std::string framed = tfrecord_frame(record);
  file_.write(framed.data(), std::streamsize(framed.size()));
}

void TensorBoardWriter::flush() {
  file_.flush();
  MOP_USER_CHECK(file_.good(), "log.tensorboard_dir: writing ", path_,
                 " failed (is the disk full?); the run stops rather than lose its metrics");
}

}  // namespace mop
