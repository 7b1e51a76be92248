// Checkpoint directory protocol: begin/commit (tmp dir, rename, latest), replacing a step,
// resume resolution (latest, fallback, .tmp and incomplete dirs ignored, explicit paths), prune.
#include <vector>

#include "catch.h"
#include "ckpt/checkpoint_dir.h"
#include "ckpt/safetensors.h"
#include "ckpt_test_util.h"
#include "test_util.h"

using namespace mop;
namespace fs = std::filesystem;

namespace {

// Commits a checkpoint at `step` with one safetensors file (registered) and one plain file
// (hashed by commit); `tag` goes into both so rewrites of a step can be told apart.
fs::path commit_step(const fs::path& root, int64_t step, float tag = 0) {
  CheckpointWriter w = CheckpointWriter::begin(root, step);
  float values[4] = {tag, 1, 2, 3};
  w.add_file("model.safetensors", write_safetensors(w.file("model.safetensors"),
                                                    {{"w", Tensor(values, DType::F32, {4})}}));
  ckpt_test::write_bytes(w.file("extra.txt"), "tag " + std::to_string(tag));
  Manifest m;
  m.config = "model: tiny\n";
  m.state["data"]["consumed_samples"] = step * 8;
  return w.commit(m);
}

std::string latest_of(const fs::path& root) {
  return ckpt_test::read_bytes(root / "latest");
}

}  // namespace

TEST_CASE("checkpoint dir names", "[cpu][ckpt]") {
  CHECK(checkpoint_dir_name(40) == "step_40");
  CHECK(parse_checkpoint_dir_name("step_40") == 40);
  CHECK(parse_checkpoint_dir_name("step_0") == 0);
  CHECK(!parse_checkpoint_dir_name("step_40.tmp"));
  CHECK(!parse_checkpoint_dir_name("step_40.old"));
  CHECK(!parse_checkpoint_dir_name("step_"));
  CHECK(!parse_checkpoint_dir_name("step_-1"));
  CHECK(!parse_checkpoint_dir_name("step_99999999999999999999"));
  CHECK(!parse_checkpoint_dir_name("latest"));
  CHECK(checkpoint_tmp_dir("ck", 7) == fs::path("ck/step_7.tmp"));
}

TEST_CASE("checkpoint commit: tmp dir, manifest, rename, latest", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp / "ckpt";  // begin creates it
  CheckpointWriter w = CheckpointWriter::begin(root, 10);
  CHECK(w.dir() == root / "step_10.tmp");
  CHECK(fs::is_directory(w.dir()));
  float values[3] = {1, 2, 3};
  FileDigest d =
      write_safetensors(w.file("model.safetensors"), {{"w", Tensor(values, DType::F32, {3})}});
  w.add_file("model.safetensors", d);
  ckpt_test::write_bytes(w.file("rank1.bin"),
                         "other rank's bytes");  // not registered: hashed at commit
  CHECK(!fs::exists(root / "latest"));           // nothing is visible before commit

  Manifest m;
  m.step = 999;  // commit sets the step
  m.config = "seed: 1\n";
  m.state["rng"]["seed"] = 1234;
  const fs::path dir = w.commit(m);
  CHECK(dir == root / "step_10");
  CHECK(fs::is_directory(dir));
  CHECK(!fs::exists(root / "step_10.tmp"));
  CHECK(!fs::exists(root / "latest.tmp"));
  CHECK(latest_of(root) == "step_10\n");

  Manifest r = verify_checkpoint(dir);
  CHECK(r.step == 10);
  CHECK(r.config == "seed: 1\n");
  CHECK(r.state.at("rng").at("seed").as_int64() == 1234);
  REQUIRE(r.files.size() == 2);
  CHECK(r.files[0].name == "model.safetensors");
  CHECK(r.files[0].sha256 == d.sha256);
  CHECK(r.files[0].bytes == d.bytes);
  CHECK(r.files[1].name == "rank1.bin");
  CHECK(r.files[1].sha256 == sha256_hex("other rank's bytes"));
  CHECK(SafetensorsFile(dir / "model.safetensors").at("w").bytes == 12);
}

TEST_CASE("checkpoint commit: stale tmp removed, existing step replaced", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp.path;
  fs::create_directories(root / "step_20.tmp");
  ckpt_test::write_bytes(root / "step_20.tmp" / "junk", "from a crashed run");
  CheckpointWriter w = CheckpointWriter::begin(root, 20);
  CHECK(!fs::exists(w.file("junk")));

  commit_step(root, 20, 1.0f);
  commit_step(root, 30, 2.0f);
  // Rewind: write step 20 again (a resumed run passing it a second time).
  commit_step(root, 20, 5.0f);
  CHECK(ckpt_test::read_bytes(root / "step_20" / "extra.txt") == "tag " + std::to_string(5.0f));
  CHECK(latest_of(root) == "step_20\n");
  verify_checkpoint(root / "step_20");
  std::vector<std::string> names;
  for (const auto& e : fs::directory_iterator(root)) names.push_back(e.path().filename().string());
  std::sort(names.begin(), names.end());
  CHECK(names == std::vector<std::string>{"latest", "step_20", "step_30"});
}

TEST_CASE("resume: auto picks latest, falls back to the highest complete step", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp / "ckpt";
  CHECK(!resolve_resume(root, ResumeMode::Auto));  // no root: fresh start
  fs::create_directories(root);
  CHECK(!resolve_resume(root, ResumeMode::Auto));  // empty root: fresh start

  commit_step(root, 10);
  commit_step(root, 20);
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_20");

  // `latest` wins over the highest step (the user rewound to step 10).
  ckpt_test::write_bytes(root / "latest", "step_10\n");
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_10");

  // Ignored: .tmp directories (even with a manifest), step dirs without a manifest, other names.
  fs::create_directories(root / "step_90.tmp");
  ckpt_test::write_bytes(root / "step_90.tmp" / "manifest.json", "{}");
  fs::create_directories(root / "step_80");
  fs::create_directories(root / "step_70.old");
  ckpt_test::write_bytes(root / "step_70.old" / "manifest.json", "{}");
  ckpt_test::write_bytes(root / "latest", "step_80\n");  // incomplete
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_20");
  ckpt_test::write_bytes(root / "latest", "step_50");  // missing
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_20");
  ckpt_test::write_bytes(root / "latest", "../elsewhere");  // not a step name
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_20");
  fs::remove(root / "latest");  // crash between the rename and the latest update
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_20");

  std::vector<CheckpointInfo> all = list_checkpoints(root);
  REQUIRE(all.size() == 2);
  CHECK((all[0].step == 10 && all[1].step == 20));

  ckpt_test::write_bytes(tmp / "file", "x");
  CHECK_USER_ERROR(resolve_resume(tmp / "file", ResumeMode::Auto), "not a directory");
}

TEST_CASE("resume: an explicit path must be a complete checkpoint", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp / "ckpt";
  commit_step(root, 40);
  CHECK(resolve_resume(root / "step_40", ResumeMode::Path) == root / "step_40");
  CHECK_USER_ERROR(resolve_resume(root / "step_50", ResumeMode::Path),
                        "checkpoint " + (root / "step_50").string() + ": not found");
  fs::create_directories(root / "step_60");
  std::string msg =
      test::user_error_of([&] { resolve_resume(root / "step_60", ResumeMode::Path); });
  CHECK(msg == "checkpoint " + (root / "step_60").string() +
                   ": no manifest.json (incomplete checkpoint?)");
  CHECK_USER_ERROR(resolve_resume(root, ResumeMode::Path), "it looks like a checkpoint root");
  CHECK_USER_ERROR(resolve_resume(root / "latest", ResumeMode::Path), "not a directory");
}

TEST_CASE("prune keeps the newest, the one latest names, and .tmp dirs", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp.path;
  for (int64_t s : {10, 20, 30, 40, 50}) commit_step(root, s);
  fs::create_directories(root / "step_5.tmp");  // a write in progress
  fs::create_directories(root / "step_1");      // incomplete: not ours to delete

  CHECK(prune_checkpoints(root, 0).empty());  // 0 keeps all
  CHECK(list_checkpoints(root).size() == 5);

  ckpt_test::write_bytes(root / "latest", "step_20\n");  // rewound: latest is old
  std::vector<fs::path> removed = prune_checkpoints(root, 2);
  CHECK(removed == std::vector<fs::path>{root / "step_10", root / "step_30"});
  std::vector<int64_t> left;
  for (const CheckpointInfo& c : list_checkpoints(root)) left.push_back(c.step);
  CHECK(left == std::vector<int64_t>{20, 40, 50});
  CHECK(fs::exists(root / "step_5.tmp"));
  CHECK(fs::exists(root / "step_1"));

  ckpt_test::write_bytes(root / "latest", "step_50\n");
  CHECK(prune_checkpoints(root, 1) == std::vector<fs::path>{root / "step_20", root / "step_40"});
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_50");
  CHECK(prune_checkpoints(root, 1).empty());
  CHECK(prune_checkpoints(tmp / "missing", 3).empty());
}

TEST_CASE("leftovers: killed saves and pruning cut short are removed at start", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp.path;
  for (int64_t s : {10, 20}) commit_step(root, s);
  fs::create_directories(root / "step_30.tmp");   // a save killed before its rename
  ckpt_test::write_bytes(root / "step_30.tmp" / "model.safetensors", "partial");
  fs::create_directories(root / "step_5");        // a prune cut short: manifest gone first
  fs::create_directories(root / "notes");         // not ours
  fs::create_directories(root / "step_x.tmp");    // not a checkpoint name
  std::vector<fs::path> removed = remove_checkpoint_leftovers(root);
  CHECK(removed == std::vector<fs::path>{root / "step_30.tmp", root / "step_5"});
  CHECK(fs::exists(root / "notes"));
  CHECK(fs::exists(root / "step_x.tmp"));
  CHECK(list_checkpoints(root).size() == 2);
  CHECK(resolve_resume(root, ResumeMode::Auto) == root / "step_20");
  // The directory `latest` names is left alone even when incomplete (resume reports it).
  fs::create_directories(root / "step_40");
  ckpt_test::write_bytes(root / "latest", "step_40\n");
  CHECK(remove_checkpoint_leftovers(root).empty());
  CHECK(remove_checkpoint_leftovers(tmp.path / "missing").empty());
}

TEST_CASE("verify: only listed tensor files, and the step its directory names", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  const fs::path root = tmp.path;
  const fs::path dir = commit_step(root, 20);
  CHECK(verify_checkpoint(dir).step == 20);
  // An extra tensor file (another run's, a stray shard) is refused, named.
  ckpt_test::write_bytes(dir / "model-rank1-of-2.safetensors", "stray");
  CHECK_THROWS_WITH(verify_checkpoint(dir), Catch::Matchers::Contains(
                                                "model-rank1-of-2.safetensors is not listed in manifest.json"));
  fs::remove(dir / "model-rank1-of-2.safetensors");
  // A manifest whose step disagrees with the directory's name (copied into the wrong step).
  fs::copy(dir, root / "step_30", fs::copy_options::recursive);
  CHECK_THROWS_WITH(verify_checkpoint(root / "step_30"),
                    Catch::Matchers::Contains("manifest.json says step 20 in a directory named step_30"));
  // A directory whose name is not a step name is taken as it is.
  fs::copy(dir, root / "final", fs::copy_options::recursive);
  CHECK(verify_checkpoint(root / "final").step == 20);
}
