// TensorBoard event files: CRC-32C against published vectors, the TFRecord framing and the Event
// encoding byte for byte, the writer's records and errors, and end to end, `mop train` with
// log.tensorboard_dir read back by the tensorboard package: every step's loss equals the metrics
// file's (rounded to float, exactly).
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <set>
#include <sstream>

#include "catch.h"
#include "core/error.h"
#include "train/metrics.h"
#include "train/tensorboard.h"
#include "train/train_test_util.h"

using namespace mop;

namespace {

uint64_t read_le(const std::string& s, size_t at, int bytes) {
  uint64_t v = 0;
  for (int i = 0; i < bytes; ++i) v |= uint64_t(uint8_t(s[at + i])) << (8 * i);
  return v;
}

// The data of every record in an event file; each record's two CRCs are checked.
std::vector<std::string> read_records(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), {});
  std::vector<std::string> out;
  size_t at = 0;
  while (at < bytes.size()) {
    REQUIRE(at + 12 <= bytes.size());
    const uint64_t len = read_le(bytes, at, 8);
    CHECK(read_le(bytes, at + 8, 4) == masked_crc32c(std::string_view(bytes).substr(at, 8)));
    REQUIRE(at + 12 + len + 4 <= bytes.size());
    const std::string data = bytes.substr(at + 12, len);
    CHECK(read_le(bytes, at + 12 + len, 4) == masked_crc32c(data));
    out.push_back(data);
    at += 12 + len + 4;
  }
  return out;
}

std::string only_event_file(const std::string& dir) {
  std::vector<std::string> files;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files.push_back(e.path().string());
  REQUIRE(files.size() == 1);
  CHECK(std::filesystem::path(files[0]).filename().string().rfind("events.out.tfevents.", 0) == 0);
  return files[0];
}

}  // namespace

TEST_CASE("tensorboard: CRC-32C matches the published check values", "[cpu][train]") {
  CHECK(crc32c("123456789") == 0xE3069283u);
  CHECK(crc32c("") == 0u);
  // RFC 3720 (iSCSI) B.4: 32 zero bytes, 32 0xff bytes, 32 bytes counting up.
  std::string zeros(32, '\0'), ones(32, '\xff'), up(32, '\0');
  for (int i = 0; i < 32; ++i) up[i] = char(i);
  CHECK(crc32c(zeros) == 0x8A9136AAu);
  CHECK(crc32c(ones) == 0x62A8AB43u);
  CHECK(crc32c(up) == 0x46DD794Eu);
  const uint32_t c = crc32c("123456789");
  CHECK(masked_crc32c("123456789") == ((c >> 15) | (c << 17)) + 0xa282ead8u);
}

TEST_CASE("tensorboard: a record is length, its masked CRC, the data, the data's masked CRC",
          "[cpu][train]") {
  const std::string data = "abc";
  const std::string f = tfrecord_frame(data);
  REQUIRE(f.size() == 8 + 4 + 3 + 4);
  CHECK(read_le(f, 0, 8) == 3);
  CHECK(read_le(f, 8, 4) == masked_crc32c(f.substr(0, 8)));
  CHECK(f.substr(12, 3) == data);
  CHECK(read_le(f, 15, 4) == masked_crc32c(data));
  CHECK(tfrecord_frame("").size() == 16);
}

TEST_CASE("tensorboard: Event protobufs encode byte for byte", "[cpu][train]") {
  // Event{wall_time: 0 (field 1, fixed64), step: 1 (field 2, varint), summary (field 5):
  //   Summary{value (field 1): Value{tag: "a" (field 1), simple_value: 1.0f (field 2, fixed32)}}}
  const std::string want(
      "\x09\0\0\0\0\0\0\0\0"
      "\x10\x01"
      "\x2a\x0a"
      "\x0a\x08"
      "\x0a\x01"
      "a"
      "\x15\x00\x00\x80\x3f",
      9 + 2 + 2 + 2 + 8);
  CHECK(event_scalar("a", 1, 1.0f, 0.0) == want);
  // A step ≥ 128 takes a two-byte varint: 300 = 0xac 0x02.
  const std::string big = event_scalar("a", 300, 1.0f, 0.0);
  CHECK(big.substr(9, 3) == std::string("\x10\xac\x02"));
  // Event{wall_time: 0, step: 3, session_log (field 7): SessionLog{status: START (field 1 = 1)}}.
  CHECK(event_session_start(3, 0.0) ==
        std::string("\x09\0\0\0\0\0\0\0\0\x10\x03\x3a\x02\x08\x01", 15));
  const std::string v = event_file_version(0.0);
  CHECK(v.substr(v.size() - 15) == std::string("\x1a\x0d") + "brain.Event:2");
}

TEST_CASE("tensorboard: the metrics log writes scalars per step and leaves non-finite ones out",
          "[cpu][train]") {
  test::TempDir dir;
  {
    MetricsLog log("", 2, 1, true, 0, 0, dir / "tb");
    StepMetrics m;
    m.step = 1, m.loss = std::numeric_limits<double>::quiet_NaN(), m.lr = 1e-3,
    m.step_seconds = 0.01, m.tokens = 64;
    log.record(m);
    m.step = 2, m.loss = 2.5, m.val_loss = 2.75;
    log.record(m);
  }
  const auto records = read_records(only_event_file(dir / "tb"));
  REQUIRE(records.size() > 2);
  CHECK(records[0].find("brain.Event:2") != std::string::npos);
  int loss_records = 0, lr_records = 0, val_records = 0;
  for (const auto& r : records) {
    loss_records += r.find("train/loss") != std::string::npos;
    lr_records += r.find("train/lr") != std::string::npos;
    val_records += r.find("val/loss") != std::string::npos;
  }
  CHECK(loss_records == 1);  // step 1's NaN is left out
  CHECK(lr_records == 2);
  CHECK(val_records == 1);
}

TEST_CASE("tensorboard: a folder that cannot be made is one error naming it", "[cpu][train]") {
  test::TempDir dir;
  test::write_text(dir / "file", "x");
  TensorBoardWriter w;
  try {
    w.open(dir / "file/tb");
    FAIL("expected a UserError");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("log.tensorboard_dir") != std::string::npos);
    CHECK(std::string(e.what()).find(dir / "file/tb") != std::string::npos);
  }
}

TEST_CASE("train: log.tensorboard_dir holds the metrics file's scalars, read by tensorboard",
          "[cpu][train]") {
  if (test::run_command("python3 -c 'import tensorboard'").code != 0) {
    WARN("skipped: python3 cannot import tensorboard (pip install tensorboard)");
    return;
  }
  test::TempDir dir;
  test::prepare_corpus(dir, 50000);
  test::write_text(dir / "cfg.yaml", R"(
model: {vocab_size: 257, hidden_size: 16, num_layers: 2, num_heads: 2, num_kv_heads: 1}
moe: {num_experts: 4, top_k: 2, expert_ffn: 16, first_dense_layers: 1, dense_ffn: 24}
optim: {lr: 0.01, min_lr: 0.001, warmup_steps: 2}
data: {paths: [)" + dir / "corpus" + R"(], seq_len: 16, valid_fraction: 0.05}
train: {steps: 5, global_batch_size: 4, micro_batch_size: 2, eval_interval: 2, eval_batches: 1}
checkpoint: {interval: 2, keep_last: 0}
log: {interval: 1}
)");
  const std::string train = "train --config " + dir / "cfg.yaml" +
                            " --set checkpoint.dir=" + dir / "run" +
                            " --set log.tensorboard_dir=" + dir / "tb";
  test::write_text(dir / "read.py", R"(import sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
ea = EventAccumulator(sys.argv[1], size_guidance={'scalars': 0})
ea.Reload()
for tag in ea.Tags()['scalars']:
    print('tag', tag)
for tag in ('train/loss', 'val/loss'):
    for s in ea.Scalars(tag):
        print('value', tag, s.step, repr(s.value))
)");
  // Checks the event files against metrics.jsonl: every step once, equal to the JSON's double
  // rounded to float (exactly: TensorBoard holds a float).
  auto check_against_metrics = [&] {
    auto py = test::run_command("python3 " + dir / "read.py" + " " + dir / "tb" + " 2>/dev/null");
    INFO(py.output);
    REQUIRE(py.code == 0);
    std::set<std::string> tags;
    std::map<std::string, std::vector<std::pair<int64_t, double>>> values;
    std::istringstream lines(py.output);
    for (std::string kind; lines >> kind;) {
      std::string t, v;
      int64_t step = 0;
      if (kind == "tag" && lines >> t) tags.insert(t);
      if (kind == "value" && lines >> t >> step >> v)
        values[t].push_back({step, std::strtod(v.c_str(), nullptr)});
    }
    for (const char* t :
         {"train/loss", "train/aux_loss", "train/z_loss", "train/lr", "train/grad_norm",
          "train/tokens_per_second", "time/step_ms", "time/attention_ms", "time/experts_ms",
          "time/phase_forward_ms", "memory/host_peak_resident_gb", "val/loss"}) {
      INFO(t);
      CHECK(tags.count(t) == 1);
    }
    const auto metrics = test::read_metrics(dir / "run/metrics.jsonl");
    REQUIRE(metrics.size() == 5);
    std::vector<std::pair<int64_t, double>> want_loss, want_val;
    for (const Json& m : metrics) {
      const int64_t step = m.at("step").as_int64("metrics");
      want_loss.push_back({step, double(float(m.at("loss").as_double()))});
      if (const Json* v = m.find("val_loss"))
        want_val.push_back({step, double(float(v->as_double()))});
    }
    CHECK(want_val.size() == 3);  // steps 2, 4 and the last
    CHECK(values["train/loss"] == want_loss);
    CHECK(values["val/loss"] == want_val);
  };
  auto r = test::run_mop(train);
  INFO(r.output);
  REQUIRE(r.code == 0);
  check_against_metrics();
  // A resume from step 2 writes steps 3-5 again into a second event file; its session start makes
  // the reader drop the first file's steps 3-5, so each step still appears once.
  auto resumed = test::run_mop(train + " --set checkpoint.resume=" + dir / "run/step_2");
  INFO(resumed.output);
  REQUIRE(resumed.code == 0);
  CHECK(resumed.output.find("resumed from") != std::string::npos);
  check_against_metrics();
}
