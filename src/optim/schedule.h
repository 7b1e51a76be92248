// Learning-rate schedules: linear warmup, then cosine decay, warmup-stable-decay, or constant.
#pragma once

#include <cstdint>

#include "config/config.h"

namespace mop {

// Learning rate of optimizer step `step` (0-based) of `total_steps`.
double learning_rate(const OptimConfig& o, int64_t step, int64_t total_steps);

}  // namespace mop
