// Step metrics: the per-interval log line (spdlog, rank 0 unless log.all_ranks) and the same
// values for every step as JSON lines in the metrics file (losses at full precision, so runs can
// be compared bit for bit; non-finite values as null, listed under "nonfinite"), and, when
// log.tensorboard_dir is set, as TensorBoard scalars (non-finite ones left out).
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

#include "config/config.h"
#include "core/tensor.h"
#include "ops/timed_ops.h"
#include "schedule/host_pipeline.h"
#include "train/tensorboard.h"

namespace mop {

struct StepMetrics {
  int64_t step = 0;  // 1-based: the step just completed
  double loss = 0, aux_loss = 0, z_loss = 0;
  double lr = 0, grad_norm = 0;
  double step_seconds = 0;
  int64_t tokens = 0;  // tokens processed by the step, all ranks
  bool skipped = false;
  double val_loss = -1;  // < 0: not evaluated this step
  double model_flops = 0;  // model FLOPs of the step (6·N_active + attention, per token)
  OpTimes times;           // device time by op category
  OffloadStats offload;    // host optimizer: transfers, update time, time the step waited
  // The overlapped device update's time on its own stream (optim.overlap): the update issued at
  // the end of the step before, which ran beside this step's forward. Its ops (memory-bound
  // AdamW) hold multiprocessors the forward's ops wait for, so on one GPU most of it shows up
  // inside the forward's categories too: `times` measures each op from start to end.
  double update_stream_seconds = 0;
};

class MetricsLog {
 public:
  // `path` empty: no file. Appends when resuming (resume_step > 0), dropping lines of steps after
  // resume_step left by a run that died after its last checkpoint.
  // peak_flops > 0: also report MFU against it (the GPU's bf16 dense peak).
  // tensorboard_dir not empty: also a TensorBoard event file there; `device` is where the memory
  // scalars look.
  MetricsLog(const std::string& path, int64_t total_steps, int64_t interval, bool write,
             int64_t resume_step, double peak_flops, const std::string& tensorboard_dir = {},
             Device device = Device::CPU);
  void record(const StepMetrics& m);

 private:
  void write_tensorboard(const StepMetrics& m);
  std::ofstream file_;
  TensorBoardWriter tensorboard_;
  Device device_;
  std::string path_;
  int64_t total_steps_, interval_;
  bool write_;
  double peak_flops_ = 0;
  double interval_seconds_ = 0, interval_flops_ = 0;
  OpTimes interval_times_;
  OffloadStats interval_offload_;
  double interval_update_stream_ = 0;
  int64_t interval_steps_ = 0, interval_tokens_ = 0;
  double avg_step_seconds_ = 0;  // exponential moving average for the ETA
};

// spdlog setup: level and rank prefix; rank > 0 is silent unless all_ranks.
void setup_logging(const LogConfig& cfg, int rank, int world_size);

}  // namespace mop
