// Checkpoint manifest: JSON round trip with trainer-defined state, a UserError for each missing or
// ill-typed field, and verification catching a flipped byte, a truncation and a missing file.
#include <fstream>

#include "catch.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/manifest.h"
#include "ckpt/safetensors.h"
#include "ckpt_test_util.h"
#include "test_util.h"

using namespace mop;
namespace fs = std::filesystem;

namespace {

Manifest sample_manifest() {
  Manifest m;
  m.step = 40;
  m.config =
      "model:\n  name: \"tiny\"  # quoted\n  layers: 2\nnote: caf\xc3\xa9 \xf0\x9f\x98\x80\n";
  m.state["data"]["consumed_samples"] = (int64_t(1) << 53) + 1;
  m.state["data"]["shard_idx"] = 3;
  m.state["rng"]["seed"] = UINT64_MAX;
  m.state["lr"] = 3e-4;
  m.state["plan"]["cp"] = 2;
  m.state["tags"].push_back("a");
  m.files.push_back({"model.safetensors", 1234, std::string(64, 'a')});
  m.files.push_back({"optim-rank0.safetensors", 0, sha256_hex("")});
  return m;
}

Json without(Json j, std::string_view key) {
  Json::Object& o = j.as_object();
  o.erase(std::remove_if(o.begin(), o.end(), [&](const auto& kv) { return kv.first == key; }),
          o.end());
  return j;
}

}  // namespace

TEST_CASE("manifest: JSON round trip keeps every field, trainer state included", "[cpu][ckpt]") {
  Manifest m = sample_manifest();
  std::string text = m.to_json().dump(2);
  Manifest r = Manifest::from_json(parse_json(text, "m.json"), "m.json");
  CHECK(r.format_version == Manifest::kFormatVersion);
  CHECK(r.step == 40);
  CHECK(r.mop_version == MOP_VERSION);
  CHECK(r.config == m.config);
  CHECK(r.state == m.state);
  CHECK(r.state.at("data").at("consumed_samples").as_int64() == (int64_t(1) << 53) + 1);
  CHECK(r.state.at("rng").at("seed").as_uint64() == UINT64_MAX);
  CHECK(r.state.at("lr").as_double() == 3e-4);
  REQUIRE(r.files.size() == 2);
  CHECK(r.files[0].name == "model.safetensors");
  CHECK(r.files[0].bytes == 1234);
  CHECK(r.files[1].sha256 == sha256_hex(""));
  CHECK(r.to_json() == m.to_json());
}

TEST_CASE("manifest: missing or ill-typed fields are UserErrors", "[cpu][ckpt]") {
  const Json good = sample_manifest().to_json();
  auto from = [](const Json& j) { return Manifest::from_json(j, "ck/step_40/manifest.json"); };
  REQUIRE_NOTHROW(from(good));
  for (const char* key : {"format_version", "step", "mop_version", "config", "state", "files"}) {
    INFO(key);
    CHECK_USER_ERROR(from(without(good, key)),
                          std::string("ck/step_40/manifest.json: missing field '") + key + "'");
  }
  auto with = [&](std::string_view key, Json v) {
    Json j = good;
    j[key] = std::move(v);
    return j;
  };
  CHECK_USER_ERROR(from(with("step", "40")),
                        "manifest.json: step: expected an integer, got a string");
  CHECK_USER_ERROR(from(with("step", -1)), "negative step");
  CHECK_USER_ERROR(from(with("config", 1)), "config: expected a string");
  CHECK_USER_ERROR(from(with("state", Json::array())), "state: expected an object");
  CHECK_USER_ERROR(from(with("format_version", 2)),
                        "format_version 2 is newer than this mop reads");
  CHECK_USER_ERROR(from(with("files", Json::object())), "files: expected an array");
  CHECK_USER_ERROR(from(Json::array()), "expected an object");

  auto with_file = [&](Json f) {
    Json j = good;
    j["files"] = Json::array();
    j["files"].push_back(std::move(f));
    return j;
  };
  auto file = [](Json name, Json bytes, Json sha) {
    Json f = Json::object();
    f["name"] = std::move(name);
    f["bytes"] = std::move(bytes);
    f["sha256"] = std::move(sha);
    return f;
  };
  const std::string sha(64, '0');
  REQUIRE_NOTHROW(from(with_file(file("a.bin", 1, sha))));
  CHECK_USER_ERROR(from(with_file(file("a.bin", -1, sha))),
                        "files[0]: bytes: expected a non-negative integer");
  CHECK_USER_ERROR(from(with_file(file("a.bin", 1, "ABC"))),
                        "files[0]: sha256 is not 64 lower-case hex digits");
  CHECK_USER_ERROR(from(with_file(file("a.bin", 1, std::string(64, 'A')))),
                        "not 64 lower-case hex digits");
  CHECK_USER_ERROR(from(with_file(file("../a.bin", 1, sha))), "invalid file name '../a.bin'");
  CHECK_USER_ERROR(from(with_file(file("manifest.json", 1, sha))), "invalid file name");
  CHECK_USER_ERROR(from(with_file(file(2, 1, sha))), "files[0]: name: expected a string");
  Json twice = with_file(file("a.bin", 1, sha));
  twice["files"].push_back(file("a.bin", 1, sha));
  CHECK_USER_ERROR(from(twice), "file 'a.bin' listed twice");
}

TEST_CASE("manifest: read_manifest names the checkpoint", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path dir = tmp / "step_40";
  fs::create_directories(dir);
  CHECK_USER_ERROR(read_manifest(dir), "checkpoint " + dir.string() +
                                                ": no manifest.json (incomplete checkpoint?)");
  ckpt_test::write_bytes(dir / "manifest.json", "{\"step\": 40,}");
  CHECK_USER_ERROR(read_manifest(dir),
                        "checkpoint " + dir.string() + ": manifest.json: invalid JSON");
  ckpt_test::write_bytes(dir / "manifest.json", "{\"step\": 40}");
  CHECK_USER_ERROR(read_manifest(dir), "checkpoint " + dir.string() +
                                                ": manifest.json: missing field 'format_version'");
}

TEST_CASE("verify: a flipped byte, a truncation and a missing file are caught", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  CheckpointWriter w = CheckpointWriter::begin(tmp.path, 40);
  std::vector<float> values(1000);
  for (size_t i = 0; i < values.size(); ++i) values[i] = float(i);
  w.add_file("model.safetensors",
             write_safetensors(w.file("model.safetensors"),
                               {{"w", Tensor(values.data(), DType::F32, {1000})}}));
  ckpt_test::write_bytes(w.file("state.bin"), std::string(100, 's'));
  const fs::path dir = w.commit(Manifest{});
  REQUIRE_NOTHROW(verify_checkpoint(dir));

  const fs::path model = dir / "model.safetensors";
  const std::string good = ckpt_test::read_bytes(model);
  std::string flipped = good;
  flipped[flipped.size() / 2] ^= 0x01;
  ckpt_test::write_bytes(model, flipped);
  std::string msg = test::user_error_of([&] { verify_checkpoint(dir); });
  CHECK(msg == "checkpoint " + dir.string() +
                   ": model.safetensors: SHA-256 mismatch (file corrupt or modified)");

  ckpt_test::write_bytes(model, good.substr(0, good.size() - 1));
  CHECK_USER_ERROR(verify_checkpoint(dir),
                        "model.safetensors: " + std::to_string(good.size() - 1) +
                            " bytes, manifest says " + std::to_string(good.size()) +
                            " (file truncated or modified)");
  ckpt_test::write_bytes(model, good);
  REQUIRE_NOTHROW(verify_checkpoint(dir));
  fs::remove(dir / "state.bin");
  CHECK_USER_ERROR(verify_checkpoint(dir),
                        "checkpoint " + dir.string() + ": state.bin: missing");
}
