// manifest.json ⇄ Manifest, and verification of a checkpoint's files against their recorded
// sizes and SHA-256 digests.
#include "ckpt/manifest.h"

#include <algorithm>
#include <system_error>

#include "ckpt/checkpoint_dir.h"
#include "ckpt/file_io.h"
#include "ckpt/sha256.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

bool is_sha256_hex(std::string_view s) {
  return s.size() == 64 && std::all_of(s.begin(), s.end(), [](char c) {
           return (c >= '0' && c <= '9') || (c >= 'a' && c <= 'f');
         });
}

// File entries must stay inside the checkpoint directory: a name is one path component.
bool is_plain_file_name(std::string_view s) {
  return !s.empty() && s != "." && s != ".." && s.find('/') == std::string_view::npos &&
         s.find('\0') == std::string_view::npos;
}

}  // namespace

Json Manifest::to_json() const {
  Json j = Json::object();
  j["format_version"] = format_version;
  j["step"] = step;
  j["mop_version"] = mop_version;
  j["config"] = config;
  j["state"] = state;
  Json fs = Json::array();
  for (const ManifestFile& f : files) {
    Json e = Json::object();
    e["name"] = f.name;
    e["bytes"] = f.bytes;
    e["sha256"] = f.sha256;
    fs.push_back(std::move(e));
  }
  j["files"] = std::move(fs);
  return j;
}

Manifest Manifest::from_json(const Json& j, std::string_view where_) {
  const std::string where(where_);
  auto field = [&](std::string_view key) -> const Json& { return j.at(key, where); };
  auto name = [&](std::string_view key) { return where + ": " + std::string(key); };
  Manifest m;
  m.format_version = field("format_version").as_int64(name("format_version"));
  if (m.format_version > kFormatVersion)
    throw_user_error(where, ": format_version ", m.format_version,
                     " is newer than this mop reads (", kFormatVersion, "); use a newer mop");
  if (m.format_version < 1) throw_user_error(where, ": invalid format_version ", m.format_version);
  m.step = field("step").as_int64(name("step"));
  if (m.step < 0) throw_user_error(where, ": negative step ", m.step);
  m.mop_version = field("mop_version").as_string(name("mop_version"));
  m.config = field("config").as_string(name("config"));
  m.state = field("state");
  m.state.as_object(name("state"));
  for (const Json& e : field("files").as_array(name("files"))) {
    const std::string ew = name("files[" + std::to_string(m.files.size()) + "]");
    ManifestFile f;
    f.name = e.at("name", ew).as_string(ew + ": name");
    f.bytes = e.at("bytes", ew).as_uint64(ew + ": bytes");
    f.sha256 = e.at("sha256", ew).as_string(ew + ": sha256");
    if (!is_plain_file_name(f.name) || f.name == kManifestName)
      throw_user_error(ew, ": invalid file name '", f.name, "'");
    if (!is_sha256_hex(f.sha256)) throw_user_error(ew, ": sha256 is not 64 lower-case hex digits");
    for (const ManifestFile& g : m.files)
      if (g.name == f.name) throw_user_error(ew, ": file '", f.name, "' listed twice");
    m.files.push_back(std::move(f));
  }
  return m;
}

Manifest read_manifest(const std::filesystem::path& dir) {
  const std::string where = "checkpoint " + dir.string() + ": " + std::string(kManifestName);
  const std::filesystem::path path = dir / kManifestName;
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec))
    throw_user_error("checkpoint ", dir.string(), ": no ", kManifestName,
                     " (incomplete checkpoint?)");
  return Manifest::from_json(parse_json(read_small_file(path, "", kConfigFileCap), where), where);
}

Manifest verify_checkpoint(const std::filesystem::path& dir) {
  Manifest m = read_manifest(dir);
  const std::string where = "checkpoint " + dir.string();
  // The directory's name and the manifest's step agree (a manifest copied into the wrong step).
  const std::string name = dir.filename().string();
  if (std::optional<int64_t> named = parse_checkpoint_dir_name(name))
    MOP_USER_CHECK(*named == m.step, where, ": manifest.json says step ", m.step, " in a directory named ",
                   name, "; the checkpoint is inconsistent, resume from another");
  // Every tensor file there is one the manifest lists (and so hashes): nothing else is loaded.
  std::error_code ec;
  for (const auto& entry : std::filesystem::directory_iterator(dir, ec)) {
    const std::string file = entry.path().filename().string();
    if (!file.ends_with(".safetensors")) continue;
    const bool listed = std::any_of(m.files.begin(), m.files.end(),
                                    [&](const ManifestFile& f) { return f.name == file; });
    MOP_USER_CHECK(listed, where, ": ", file, " is not listed in manifest.json (a file from another "
                   "run or step?); remove it, or resume from another checkpoint");
  }
  if (ec) throw_user_error(where, ": cannot list: ", ec.message());
  for (const ManifestFile& f : m.files) {
    const std::string fw = "checkpoint " + dir.string() + ": " + f.name;
    const std::filesystem::path path = dir / f.name;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path, ec)) throw_user_error(fw, ": missing");
    uint64_t size = std::filesystem::file_size(path, ec);
    if (ec) throw_user_error(fw, ": ", ec.message());
    if (size != f.bytes)  // cheap check first: a truncated file needs no hashing
      throw_user_error(fw, ": ", size, " bytes, manifest says ", f.bytes,
                       " (file truncated or modified)");
    FileDigest d = sha256_file(path);
    if (d.bytes != f.bytes)
      throw_user_error(fw, ": ", d.bytes, " bytes, manifest says ", f.bytes,
                       " (file truncated or modified)");
    if (d.sha256 != f.sha256) throw_user_error(fw, ": SHA-256 mismatch (file corrupt or modified)");
  }
  return m;
}

}  // namespace mop
