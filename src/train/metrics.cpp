// Log lines, the JSON-lines metrics file and the TensorBoard scalars.
#include "train/metrics.h"

#include <spdlog/sinks/stdout_color_sinks.h>
#include <spdlog/spdlog.h>

#include <cctype>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <sstream>
#include <vector>

#include "ckpt/json.h"
#include "core/error.h"
#include "core/format.h"
#include "core/small_file.h"
#include "runtime/memory.h"
#include "runtime/runtime.h"

namespace mop {

namespace {

std::string format_duration(double seconds) {
  int64_t s = int64_t(seconds + 0.5);
  char buf[32];
  if (s >= 3600)
    std::snprintf(buf, sizeof buf, "%lldh%02lldm", (long long)(s / 3600), (long long)(s % 3600 / 60));
  else
    std::snprintf(buf, sizeof buf, "%lldm%02llds", (long long)(s / 60), (long long)(s % 60));
  return buf;
}

// Keeps the lines of steps ≤ resume_step (a resumed run rewrites the rest). A last line that does
// not parse or lacks its newline is what a crash in mid-write leaves: dropped with a warning.
// Anything else that is not a metrics line is named by file and line.
void truncate_after(const std::string& path, int64_t resume_step) {
  // A device or pipe (log.metrics_file: /dev/null) has no earlier lines to keep.
  std::error_code ec;
  if (!std::filesystem::is_regular_file(path, ec)) return;
  const std::string text = read_small_file(path, "log.metrics_file", kTextFileCap);
  std::vector<std::string> keep;
  size_t begin = 0;
  for (int64_t line_no = 1; begin < text.size(); ++line_no) {
    const size_t end = text.find('\n', begin);
    const bool complete = end != std::string::npos;
    const std::string line = text.substr(begin, (complete ? end : text.size()) - begin);
    begin = complete ? end + 1 : text.size();
    const bool last = begin >= text.size();
    if (line.empty()) continue;
    const std::string where = path + ":" + std::to_string(line_no);
    int64_t step = -1;
    try {
      const Json j = parse_json(line, where);
      if (const Json* v = j.find("step"); v && v->is_integer()) step = v->as_int64(where);
    } catch (const UserError&) {
      step = -1;
    }
    if (step < 0 || !complete) {
      MOP_USER_CHECK(last, where, ": not a metrics line (each line is a JSON object with a \"step\"); "
                     "fix or remove it to resume");
      spdlog::warn("{}: dropping a torn last line (a run stopped while writing it)", where);
      continue;
    }
    if (step <= resume_step) keep.push_back(line);
  }
  std::ofstream out(path, std::ios::trunc);
  for (const auto& l : keep) out << l << "\n";
  MOP_USER_CHECK(out.good(), path, ": cannot rewrite the metrics file");
}

// An op category as a TensorBoard tag: "LM head+loss" → "lm_head_loss", "dense GEMMs" →
// "dense_gemms".
std::string tag_name(const char* name) {
  std::string out;
  for (const char* c = name; *c; ++c) {
    if (std::isalnum((unsigned char)*c))
      out.push_back(char(std::tolower((unsigned char)*c)));
    else if (!out.empty() && out.back() != '_')
      out.push_back('_');
  }
  while (!out.empty() && out.back() == '_') out.pop_back();
  return out;
}

}  // namespace

MetricsLog::MetricsLog(const std::string& path, int64_t total_steps, int64_t interval, bool write,
                       int64_t resume_step, double peak_flops, const std::string& tensorboard_dir,
                       Device device)
    : device_(device),
      total_steps_(total_steps),
      interval_(interval),
      write_(write),
      peak_flops_(peak_flops) {
  if (write_ && !tensorboard_dir.empty()) tensorboard_.open(tensorboard_dir, resume_step);
  if (!write_ || path.empty()) return;
  std::filesystem::path p(path);
  std::error_code ec;
  if (p.has_parent_path()) std::filesystem::create_directories(p.parent_path(), ec);
  path_ = path;
  if (resume_step > 0)
    truncate_after(path, resume_step);
  file_.open(path, resume_step > 0 ? std::ios::app : std::ios::trunc);
  MOP_USER_CHECK(file_.good(), "log.metrics_file: cannot write ", path);
}

// The metrics line's values as scalars: train/ (losses, lr, throughput), time/ (by op category
// and phase, ms), host_optimizer/, memory/, val/. TensorBoard floats could hold NaN, but the JSON
// has none, so a non-finite value is left out here too.
void MetricsLog::write_tensorboard(const StepMetrics& m) {
  const double wall =
      std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
  auto scalar = [&](const std::string& tag, double v) {
    if (std::isfinite(v)) tensorboard_.scalar(tag, m.step, v, wall);
  };
  scalar("train/loss", m.loss);
  scalar("train/aux_loss", m.aux_loss);
  scalar("train/z_loss", m.z_loss);
  scalar("train/lr", m.lr);
  scalar("train/grad_norm", m.grad_norm);
  const double seconds = std::max(m.step_seconds, 1e-9);
  scalar("train/tokens_per_second", double(m.tokens) / seconds);
  scalar("train/model_tflops", m.model_flops / seconds / 1e12);
  if (peak_flops_ > 0) scalar("train/mfu_percent", 100.0 * m.model_flops / seconds / peak_flops_);
  scalar("train/skipped", m.skipped ? 1.0 : 0.0);
  scalar("time/step_ms", 1e3 * m.step_seconds);
  for (int c = 0; c < kNumOpCategories; ++c)
    scalar("time/" + tag_name(op_category_name(OpCategory(c))) + "_ms", 1e3 * m.times.seconds[c]);
  const char* phases[kNumStepPhases] = {"forward", "backward", "optimizer"};
  for (int c = 0; c < kNumStepPhases; ++c)
    scalar(std::string("time/phase_") + phases[c] + "_ms", 1e3 * m.times.phase_seconds[c]);
  if (m.update_stream_seconds > 0) scalar("time/update_stream_ms", 1e3 * m.update_stream_seconds);
  if (m.offload.update_seconds > 0) {
    scalar("host_optimizer/update_ms", 1e3 * m.offload.update_seconds);
    scalar("host_optimizer/state_ms", 1e3 * m.offload.state_seconds);
    scalar("host_optimizer/wait_ms", 1e3 * m.offload.wait_seconds);
    scalar("host_optimizer/to_host_mb", m.offload.bytes_to_host / 1e6);
    scalar("host_optimizer/to_device_mb", m.offload.bytes_to_device / 1e6);
  }
  if (const size_t peak = peak_resident_bytes(); peak > 0)
    scalar("memory/host_peak_resident_gb", double(peak) / 1e9);
  if (device_ == Device::CUDA) {
    // The whole GPU's memory in use (other processes' too), as nvidia-smi reports it.
    const MemoryInfo info = memory_info(Device::CUDA);
    scalar("memory/device_in_use_gb", double(info.total - info.free) / 1e9);
  }
  if (m.val_loss >= 0 || std::isnan(m.val_loss)) scalar("val/loss", m.val_loss);
  tensorboard_.flush();
}

void MetricsLog::record(const StepMetrics& m) {
  if (!write_) return;
  if (tensorboard_.is_open()) write_tensorboard(m);
  avg_step_seconds_ = avg_step_seconds_ == 0 ? m.step_seconds : 0.9 * avg_step_seconds_ + 0.1 * m.step_seconds;
  interval_seconds_ += m.step_seconds;
  interval_steps_ += 1;
  interval_tokens_ += m.tokens;
  interval_flops_ += m.model_flops;
  for (int c = 0; c < kNumOpCategories; ++c) interval_times_.seconds[c] += m.times.seconds[c];
  for (int c = 0; c < kNumStepPhases; ++c) interval_times_.phase_seconds[c] += m.times.phase_seconds[c];
  interval_offload_.bytes_to_host += m.offload.bytes_to_host;
  interval_offload_.bytes_to_device += m.offload.bytes_to_device;
  interval_offload_.update_seconds += m.offload.update_seconds;
  interval_offload_.state_seconds += m.offload.state_seconds;
  interval_offload_.wait_seconds += m.offload.wait_seconds;
  interval_update_stream_ += m.update_stream_seconds;
  if (file_.is_open()) {
    Json j = Json::object();
    // JSON has no NaN or Inf: a non-finite value is written as null and its key listed in
    // "nonfinite" (a skipped step's loss, say).
    Json nonfinite = Json::array();
    auto number = [&](const char* key, double v) {
      if (std::isfinite(v)) {
        j[key] = v;
      } else {
        j[key] = Json(nullptr);
        nonfinite.push_back(std::string(key) + (std::isnan(v) ? ": nan" : v > 0 ? ": inf" : ": -inf"));
      }
    };
    j["step"] = m.step;
    number("loss", m.loss);
    number("aux_loss", m.aux_loss);
    number("z_loss", m.z_loss);
    number("lr", m.lr);
    number("grad_norm", m.grad_norm);
    j["step_seconds"] = m.step_seconds;
    j["tokens"] = m.tokens;
    j["model_tflops"] = m.model_flops / std::max(m.step_seconds, 1e-9) / 1e12;
    Json t = Json::object();
    for (int c = 0; c < kNumOpCategories; ++c) t[op_category_name(OpCategory(c))] = m.times.seconds[c];
    j["op_seconds"] = std::move(t);
    Json ph = Json::object();
    const char* names[kNumStepPhases] = {"forward", "backward", "optimizer"};
    for (int c = 0; c < kNumStepPhases; ++c) ph[names[c]] = m.times.phase_seconds[c];
    j["phase_seconds"] = std::move(ph);
    if (m.update_stream_seconds > 0) j["update_stream_seconds"] = m.update_stream_seconds;
    if (m.offload.update_seconds > 0) {
      Json o = Json::object();
      o["update_seconds"] = m.offload.update_seconds;
      o["state_seconds"] = m.offload.state_seconds;
      o["wait_seconds"] = m.offload.wait_seconds;
      o["bytes_to_host"] = m.offload.bytes_to_host;
      o["bytes_to_device"] = m.offload.bytes_to_device;
      j["host_optimizer"] = std::move(o);
    }
    if (m.skipped) j["skipped"] = true;
    if (m.val_loss >= 0 || std::isnan(m.val_loss)) number("val_loss", m.val_loss);
    if (nonfinite.size() > 0) j["nonfinite"] = std::move(nonfinite);
    file_ << j.dump() << "\n";
    file_.flush();
    MOP_USER_CHECK(file_.good(), "log.metrics_file: writing ", path_,
                   " failed (is the disk full?); the run stops rather than lose its metrics");
  }
  bool last = m.step == total_steps_;
  if (m.step % interval_ == 0 || last || m.val_loss >= 0) {
    double tok_s = interval_tokens_ / std::max(interval_seconds_, 1e-9);
    double eta = avg_step_seconds_ * double(total_steps_ - m.step);
    spdlog::info("step {:>6}/{} | loss {:.4f} | aux {:.2e} | lr {:.3e} | grad {:.3f} | {} tok/s | {:.0f} ms/step | eta {}{}{}",
                 m.step, total_steps_, m.loss, m.aux_loss + m.z_loss, m.lr, m.grad_norm, grouped(tok_s),
                 1000.0 * interval_seconds_ / double(interval_steps_), format_duration(eta),
                 m.val_loss >= 0 ? fmt::format(" | val {:.4f}", m.val_loss) : std::string(),
                 m.skipped ? " | SKIPPED" : "");
    double tflops = interval_flops_ / std::max(interval_seconds_, 1e-9) / 1e12;
    std::string mfu = peak_flops_ > 0 ? fmt::format(", MFU {:.1f}%", 100e12 * tflops / peak_flops_) : "";
    OpTimes per_step = interval_times_;
    for (double& x : per_step.seconds) x /= double(interval_steps_);
    for (double& x : per_step.phase_seconds) x /= double(interval_steps_);
    const double update_ms = 1e3 * interval_update_stream_ / double(interval_steps_);
    spdlog::info("             model {:.3g} TFLOP/s{} | per step: forward {:.0f} ms, backward {:.0f} "
                 "ms, optimizer {:.0f} ms, step {:.0f} ms | {}{}",
                 tflops, mfu, 1e3 * per_step.phase_seconds[0], 1e3 * per_step.phase_seconds[1],
                 1e3 * per_step.phase_seconds[2], 1e3 * interval_seconds_ / double(interval_steps_),
                 per_step.describe(),
                 update_ms > 0 ? fmt::format(" | update stream {:.0f} ms (beside the forward)", update_ms)
                               : std::string());
    if (interval_offload_.update_seconds > 0) {
      double k = 1.0 / double(interval_steps_);
      const double state_ms = 1e3 * k * interval_offload_.state_seconds;
      spdlog::info("             host optimizer per step: update {:.0f} ms{}, exposed (step waited) "
                   "{:.0f} ms, to host {}, to device {}",
                   1e3 * k * interval_offload_.update_seconds,
                   state_ms > 0 ? fmt::format(" until the new weights + {:.0f} ms state pass", state_ms)
                                : std::string(),
                   1e3 * k * interval_offload_.wait_seconds,
                   format_bytes(k * interval_offload_.bytes_to_host),
                   format_bytes(k * interval_offload_.bytes_to_device));
    }
    interval_offload_ = OffloadStats{};
    interval_seconds_ = interval_flops_ = 0;
    interval_times_ = OpTimes{};
    interval_update_stream_ = 0;
    interval_steps_ = interval_tokens_ = 0;
  }
}

void setup_logging(const LogConfig& cfg, int rank, int world_size) {
  auto logger = spdlog::stdout_color_mt("mop" + std::to_string(rank));
  spdlog::set_default_logger(logger);
  std::string prefix = world_size > 1 ? fmt::format("[rank {}] ", rank) : "";
  spdlog::set_pattern("[%Y-%m-%d %H:%M:%S] " + prefix + "%^%l%$ %v");
  spdlog::set_level(spdlog::level::from_str(cfg.level));
  if (rank != 0 && !cfg.all_ranks) spdlog::set_level(spdlog::level::warn);
}

}  // namespace mop
