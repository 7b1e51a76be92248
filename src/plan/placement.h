// Where a plan puts what it may place: each segment's optimizer state (device or pinned host
// memory) and, with recompute, each layer's saved tensors (kept attention, host layers) — the
// largest device use that fits, decided from Plan::memory_of_rank. Used by make_plan.
#pragma once

#include <cstddef>
#include <vector>

#include "plan/plan.h"

namespace mop {

// Per segment (model/params.h) whether its optimizer state lives in host memory, from
// optim.state_placement: gpu, host, or auto (segments in forward order on the device while they
// fit beside `device_used`).
std::vector<bool> place_state(Plan& p, const ModelLayout& local, size_t device_used);
// With recompute: activation_options.keep_attention and host_layers (pinned counts kept).
void place_saved(Plan& p, const ModelDims& local_dims);

}  // namespace mop
