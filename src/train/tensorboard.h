// TensorBoard event files written natively: records framed as TFRecord (length, masked CRC-32C
// of the length, data, masked CRC-32C of the data) holding hand-encoded `Event` protobufs with
// scalar summaries. No protobuf or TensorFlow dependency.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <string_view>

namespace mop {

// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), as TFRecord frames use it.
uint32_t crc32c(std::string_view data);
// TFRecord's masked CRC: ((crc >> 15) | (crc << 17)) + 0xa282ead8.
uint32_t masked_crc32c(std::string_view data);
// One TFRecord: uint64 LE length, uint32 LE masked crc of those 8 bytes, the data, uint32 LE
// masked crc of the data.
std::string tfrecord_frame(std::string_view data);
// Serialized Event{wall_time, step, file_version} and Event{wall_time, step, summary{value{tag,
// simple_value}}}.
std::string event_file_version(double wall_time);
std::string event_scalar(const std::string& tag, int64_t step, float value, double wall_time);
// Event{wall_time, step, session_log{status: START}}: TensorBoard's reader drops the events of
// earlier files at steps ≥ `step` (those a resumed run writes again).
std::string event_session_start(int64_t step, double wall_time);

class TensorBoardWriter {
 public:
  // Creates `dir` and events.out.tfevents.<unix seconds>.<hostname> in it, starting with the
  // file_version record; resume_step > 0 adds a session start at resume_step + 1. Errors are
  // UserErrors naming the file.
  void open(const std::string& dir, int64_t resume_step = 0);
  bool is_open() const { return file_.is_open(); }
  const std::string& path() const { return path_; }
  void scalar(const std::string& tag, int64_t step, double value, double wall_time);
  void flush();  // once per step: the file is readable while the run goes on

 private:
  void write(const std::string& record);
  std::ofstream file_;
  std::string path_;
};

}  // namespace mop
