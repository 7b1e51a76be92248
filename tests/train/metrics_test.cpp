// The metrics file: non-finite values stay valid JSON (null, listed under "nonfinite"); resume
// drops a torn last line and names any other malformed line by file and line.
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>
#include <vector>

#include "catch.h"
#include "ckpt/json.h"
#include "test_util.h"
#include "train/metrics.h"

using namespace mop;

namespace {

std::vector<std::string> lines_of(const std::string& path) {
  std::ifstream in(path);
  std::vector<std::string> out;
  for (std::string l; std::getline(in, l);) out.push_back(l);
  return out;
}

StepMetrics step(int64_t n, double loss) {
  StepMetrics m;
  m.step = n, m.loss = loss, m.lr = 1e-3, m.grad_norm = 0.5, m.step_seconds = 0.01, m.tokens = 64;
  return m;
}

void write(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

}  // namespace

TEST_CASE("metrics: a non-finite loss is written as null and named", "[cpu][train]") {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  {
    MetricsLog log(path, 3, 100, true, 0, 0);
    log.record(step(1, 2.5));
    StepMetrics bad = step(2, std::numeric_limits<double>::quiet_NaN());
    bad.grad_norm = std::numeric_limits<double>::infinity();
    bad.skipped = true;
    log.record(bad);
    log.record(step(3, 2.25));
  }
  const std::vector<std::string> lines = lines_of(path);
  REQUIRE(lines.size() == 3);
  for (const std::string& l : lines) CHECK_NOTHROW(parse_json(l, "metrics"));
  const Json j = parse_json(lines[1], "metrics");
  CHECK(j.at("loss").is_null());
  CHECK(j.at("grad_norm").is_null());
  CHECK(j.at("skipped").as_bool());
  const Json::Array& named = j.at("nonfinite").as_array();
  REQUIRE(named.size() == 2);
  CHECK(named[0].as_string() == "loss: nan");
  CHECK(named[1].as_string() == "grad_norm: inf");
  CHECK(parse_json(lines[2], "metrics").at("loss").as_double() == 2.25);
  CHECK(parse_json(lines[0], "metrics").find("nonfinite") == nullptr);
}

TEST_CASE("metrics: resume keeps earlier steps, drops a torn last line, names a bad one",
          "[cpu][train]") {
  test::TempDir dir;
  const std::string path = dir / "metrics.jsonl";
  const std::string good = "{\"step\":1,\"loss\":3}\n{\"step\":2,\"loss\":2}\n{\"step\":3,\"loss\":1}\n";
  SECTION("a torn last line (no newline) is dropped") {
    write(path, good + "{\"step\":4,\"lo");
    { MetricsLog log(path, 5, 100, true, 2, 0); }
    CHECK(lines_of(path) == std::vector<std::string>{"{\"step\":1,\"loss\":3}", "{\"step\":2,\"loss\":2}"});
  }
  SECTION("a last line that does not parse is dropped") {
    write(path, good + "{\"step\":4,\"lo\n");
    { MetricsLog log(path, 5, 100, true, 3, 0); }
    CHECK(lines_of(path).size() == 3);
  }
  SECTION("a malformed line before the last stops the resume, named") {
    write(path, "{\"step\":1,\"loss\":3}\ngarbage\n{\"step\":2,\"loss\":2}\n");
    try {
      MetricsLog log(path, 5, 100, true, 2, 0);
      FAIL("accepted a malformed metrics line");
    } catch (const UserError& e) {
      CHECK(std::string(e.what()).find(path + ":2: not a metrics line") != std::string::npos);
    }
  }
  SECTION("null values and non-finite steps read back") {
    write(path, "{\"step\":1,\"loss\":null,\"nonfinite\":[\"loss: nan\"]}\n{\"step\":2,\"loss\":2}\n");
    { MetricsLog log(path, 5, 100, true, 1, 0); }
    CHECK(lines_of(path).size() == 1);
  }
}

TEST_CASE("metrics: a write that fails stops the run with the file named", "[cpu][train]") {
  if (!std::ifstream("/dev/full")) {
    WARN("no /dev/full here: not checked");
    return;
  }
  MetricsLog log("/dev/full", 2, 100, true, 0, 0);
  try {
    log.record(step(1, 2.0));
    FAIL("a failed write went unnoticed");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()).find("writing /dev/full failed") != std::string::npos);
  }
}
