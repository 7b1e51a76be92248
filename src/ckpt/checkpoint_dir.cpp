// Checkpoint directory protocol: begin / commit (durable, atomic), resume resolution, retention.
// Ordering is what makes it crash-safe: file data is fsynced before manifest.json is written,
// manifest.json before the rename, the rename (root fsync) before `latest` is replaced.
#include "ckpt/checkpoint_dir.h"

#include <fcntl.h>
#include <spdlog/spdlog.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE (glibc ≥ 2.28)

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>

#include "ckpt/file_io.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace fs = std::filesystem;

namespace {

constexpr std::string_view kLatestName = "latest";

void remove_all_or_throw(const fs::path& p) {
  std::error_code ec;
  fs::remove_all(p, ec);
  if (ec) throw_user_error("cannot remove ", p.string(), ": ", ec.message());
}

// The directory name `latest` holds, if the file exists and holds a step_<N> name.
std::optional<std::string> read_latest(const fs::path& root) {
  const fs::path path = root / kLatestName;
  std::error_code ec;
  if (!fs::exists(fs::symlink_status(path, ec))) return std::nullopt;
  std::string s = read_small_file(path, "", kConfigFileCap);
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  if (!parse_checkpoint_dir_name(s)) {
    spdlog::warn("{}: does not name a step_<N> directory; ignored", path.string());
    return std::nullopt;
  }
  return s;
}

// Puts `from` (a complete new checkpoint) in place of the existing directory `to`.
void replace_dir(const fs::path& from, const fs::path& to) {
  // RENAME_EXCHANGE swaps the two atomically, so step_<N> is always one complete checkpoint;
  // the old one ends up at `from` (a .tmp name, which nothing resolves to) and is deleted.
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) {
    fsync_path(to.parent_path());
    remove_all_or_throw(from);
    return;
  }
  if (errno != EINVAL && errno != ENOSYS && errno != ENOTSUP)
    throw_user_error("cannot replace ", to.string(), " with ", from.string(), ": ",
                     std::strerror(errno));
  // No exchange on this file system (e.g. some network file systems): move the old one aside
  // first. A crash between the two renames leaves no step_<N>; resume then falls back to the
  // highest complete checkpoint.
  fs::path aside = to;
  aside += ".old";
  remove_all_or_throw(aside);
  rename_path(to, aside);
  rename_path(from, to);
  fsync_path(to.parent_path());
  remove_all_or_throw(aside);
}

}  // namespace

std::string checkpoint_dir_name(int64_t step) {
  MOP_CHECK(step >= 0, "step ", step);
  return "step_" + std::to_string(step);
}

std::optional<int64_t> parse_checkpoint_dir_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step_";
  if (!name.starts_with(kPrefix)) return std::nullopt;
  std::string_view digits = name.substr(kPrefix.size());
  if (digits.empty() ||
      !std::all_of(digits.begin(), digits.end(), [](char c) { return c >= '0' && c <= '9'; }))
    return std::nullopt;
  int64_t step = 0;
  auto [ptr, ec] = std::from_chars(digits.data(), digits.data() + digits.size(), step);
  if (ec != std::errc() || ptr != digits.data() + digits.size()) return std::nullopt;
  return step;
}

fs::path checkpoint_tmp_dir(const fs::path& root, int64_t step) {
  return root / (checkpoint_dir_name(step) + ".tmp");
}

bool is_complete_checkpoint(const fs::path& dir) {
  std::error_code ec;
  return fs::is_regular_file(dir / kManifestName, ec);
}

std::vector<CheckpointInfo> list_checkpoints(const fs::path& root) {
  std::vector<CheckpointInfo> out;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return out;
  fs::directory_iterator it(root, ec);
  if (ec) throw_user_error("cannot list checkpoint root ", root.string(), ": ", ec.message());
  for (const fs::directory_entry& e : it) {
    std::optional<int64_t> step = parse_checkpoint_dir_name(e.path().filename().string());
    if (step && e.is_directory(ec) && is_complete_checkpoint(e.path()))
      out.push_back({*step, e.path()});
  }
  std::sort(out.begin(), out.end(),
            [](const CheckpointInfo& a, const CheckpointInfo& b) { return a.step < b.step; });
  return out;
}

CheckpointWriter CheckpointWriter::begin(const fs::path& root_arg, int64_t step) {
  MOP_CHECK(step >= 0, "checkpoint step ", step);
  const fs::path root = root_arg.empty() ? fs::path(".") : root_arg;  // so root / name has a parent
  std::error_code ec;
  fs::create_directories(root, ec);
  if (ec)
    throw_user_error("cannot create checkpoint directory ", root.string(), ": ", ec.message());
  fs::path tmp = checkpoint_tmp_dir(root, step);
  remove_all_or_throw(tmp);
  fs::create_directory(tmp, ec);
  if (ec) throw_user_error("cannot create ", tmp.string(), ": ", ec.message());
  return CheckpointWriter(root, step, tmp);
}

void CheckpointWriter::add_file(const std::string& name, FileDigest digest) {
  MOP_CHECK(!committed_, "add_file after commit");
  digests_[name] = std::move(digest);
}

fs::path CheckpointWriter::commit(Manifest manifest) {
  MOP_CHECK(!committed_, "checkpoint ", tmp_dir_.string(), " committed twice");
  std::error_code ec;
  std::vector<ManifestFile> files;
  fs::directory_iterator it(tmp_dir_, ec);
  if (ec) throw_user_error("cannot list ", tmp_dir_.string(), ": ", ec.message());
  for (const fs::directory_entry& e : it) {
    std::string name = e.path().filename().string();
    if (name == kManifestName) continue;  // rewritten below
    MOP_CHECK(e.is_regular_file(ec), e.path().string(),
              ": checkpoint directories hold plain files only");
    FileDigest d;
    if (auto r = digests_.find(name); r != digests_.end()) {
      uint64_t size = fs::file_size(e.path(), ec);
      MOP_CHECK(!ec && size == r->second.bytes, e.path().string(), ": ", size, " bytes on disk, ",
                r->second.bytes, " recorded by add_file");
      d = r->second;
    } else {
      d = sha256_file(e.path());
    }
    fsync_path(e.path());  // a no-op for files their writer fsynced; cheap insurance for others
    files.push_back({name, d.bytes, d.sha256});
  }
  for (const auto& digest : digests_) {  // no structured binding: clang < 16 cannot capture one
    const std::string& name = digest.first;
    MOP_CHECK(std::any_of(files.begin(), files.end(),
                          [&](const ManifestFile& f) { return f.name == name; }),
              "add_file(\"", name, "\") but no such file in ", tmp_dir_.string());
  }
  std::sort(files.begin(), files.end(),
            [](const ManifestFile& a, const ManifestFile& b) { return a.name < b.name; });
  manifest.step = step_;
  manifest.files = std::move(files);
  write_file_durable(tmp_dir_ / kManifestName, manifest.to_json().dump(2));
  fsync_path(tmp_dir_);

  const std::string name = checkpoint_dir_name(step_);
  const fs::path final_dir = root_ / name;
  if (fs::exists(final_dir, ec)) {
    replace_dir(tmp_dir_, final_dir);
  } else {
    rename_path(tmp_dir_, final_dir);
    fsync_path(root_);
  }
  write_file_atomic(root_ / kLatestName, name + "\n");
  committed_ = true;
  return final_dir;
}

std::optional<fs::path> resolve_resume(const fs::path& p, ResumeMode mode) {
  std::error_code ec;
  if (mode == ResumeMode::Path) {
    fs::file_status st = fs::status(p, ec);
    if (!fs::exists(st)) throw_user_error("checkpoint ", p.string(), ": not found");
    if (!fs::is_directory(st)) throw_user_error("checkpoint ", p.string(), ": not a directory");
    if (!is_complete_checkpoint(p)) {
      bool is_root = fs::exists(p / kLatestName, ec) || !list_checkpoints(p).empty();
      throw_user_error(
          "checkpoint ", p.string(), ": no ", kManifestName, " (incomplete checkpoint?)",
          is_root ? "; it looks like a checkpoint root: name a step_<N> directory in it, or resume "
                    "from it with \"auto\""
                  : "");
    }
    return p;
  }
  fs::file_status st = fs::status(p, ec);
  if (!fs::exists(st)) return std::nullopt;
  if (!fs::is_directory(st)) throw_user_error("checkpoint root ", p.string(), ": not a directory");
  std::optional<std::string> latest = read_latest(p);
  if (latest) {
    if (is_complete_checkpoint(p / *latest)) return p / *latest;
  }
  std::vector<CheckpointInfo> all = list_checkpoints(p);
  if (all.empty()) {
    if (latest)
      spdlog::warn("{}/latest names {}, which is missing or incomplete; starting fresh", p.string(),
                   *latest);
    return std::nullopt;
  }
  if (latest)
    spdlog::warn("{}/latest names {}, which is missing or incomplete; resuming from {} instead",
                 p.string(), *latest, all.back().dir.filename().string());
  return all.back().dir;
}

std::vector<fs::path> prune_checkpoints(const fs::path& root, int keep_last) {
  MOP_CHECK(keep_last >= 0, "keep_last ", keep_last);
  std::vector<fs::path> removed;
  if (keep_last == 0) return removed;
  std::vector<CheckpointInfo> all = list_checkpoints(root);
  if (all.size() <= size_t(keep_last)) return removed;
  std::optional<std::string> latest = read_latest(root);
  for (size_t i = 0; i + size_t(keep_last) < all.size(); ++i) {
    const fs::path& dir = all[i].dir;
    if (latest && dir.filename() == *latest) continue;
    // manifest.json goes first: a deletion cut short leaves an incomplete directory, which no
    // resume will pick, rather than a "complete" one with files missing.
    std::error_code ec;
    fs::remove(dir / kManifestName, ec);
    if (ec) throw_user_error("cannot remove ", (dir / kManifestName).string(), ": ", ec.message());
    fsync_path(dir);
    remove_all_or_throw(dir);
    removed.push_back(dir);
  }
  if (!removed.empty()) fsync_path(root);
  return removed;
}

std::vector<fs::path> remove_checkpoint_leftovers(const fs::path& root) {
  std::vector<fs::path> removed;
  std::error_code ec;
  if (!fs::is_directory(root, ec)) return removed;
  const std::optional<std::string> latest = read_latest(root);
  std::vector<fs::path> doomed;
  for (const fs::directory_entry& e : fs::directory_iterator(root, ec)) {
    if (!e.is_directory(ec)) continue;
    const std::string name = e.path().filename().string();
    const bool tmp = name.size() > 4 && name.compare(name.size() - 4, 4, ".tmp") == 0 &&
                     parse_checkpoint_dir_name(name.substr(0, name.size() - 4));
    const bool incomplete = parse_checkpoint_dir_name(name) && !is_complete_checkpoint(e.path()) &&
                            !(latest && *latest == name);
    if (tmp || incomplete) doomed.push_back(e.path());
  }
  if (ec) throw_user_error("cannot list checkpoint root ", root.string(), ": ", ec.message());
  std::sort(doomed.begin(), doomed.end());
  for (const fs::path& d : doomed) {
    remove_all_or_throw(d);
    removed.push_back(d);
  }
  if (!removed.empty()) fsync_path(root);
  return removed;
}

}  // namespace mop
