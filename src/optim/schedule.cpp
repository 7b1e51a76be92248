// Learning-rate schedules (see schedule.h). Warmup reaches the peak at step warmup_steps − 1, so
// the first step already trains; decays end exactly at min_lr on the last step.
#include "optim/schedule.h"

#include <algorithm>
#include <cmath>

namespace mop {

double learning_rate(const OptimConfig& o, int64_t step, int64_t total_steps) {
  if (step < o.warmup_steps) return o.lr * double(step + 1) / double(o.warmup_steps);
  if (o.schedule == "constant") return o.lr;
  if (o.schedule == "cosine") {
    int64_t span = std::max<int64_t>(1, total_steps - o.warmup_steps - 1);
    double p = std::min(1.0, double(step - o.warmup_steps) / double(span));
    return o.min_lr + (o.lr - o.min_lr) * 0.5 * (1.0 + std::cos(M_PI * p));
  }
  // wsd: stable at lr, then linear decay over the last decay_fraction of the steps.
  int64_t decay_steps = int64_t(std::llround(o.decay_fraction * double(total_steps)));
  int64_t decay_start = std::max(o.warmup_steps, total_steps - decay_steps);
  if (step < decay_start || decay_steps == 0) return o.lr;
  int64_t span = std::max<int64_t>(1, total_steps - decay_start);
  double p = std::min(1.0, double(step - decay_start + 1) / double(span));
  return o.lr + (o.min_lr - o.lr) * p;
}

}  // namespace mop
