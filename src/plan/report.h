// What `mop plan` prints: a plan per component (placement, memory per rank on the device and the
// host, predicted time per step and what overlaps it), the memory classes, the time split, tokens/s
// and MFU — as text or JSON — and the ranked table of a plan search with the rejected plans and
// why.
#pragma once

#include <string>

#include "ckpt/json.h"
#include "plan/plan.h"
#include "plan/program.h"
#include "plan/search.h"

namespace mop {

std::string plan_text(const Plan& plan);
Json plan_json(const Plan& plan);
// The `top` fastest plans, then the rejected ones grouped by reason (a few settings each).
std::string search_text(const SearchResult& result, int top);
Json search_json(const SearchResult& result, int top);
// A step program's actions in order: {"action", "stream", "segments": [a, b], "micro_batch"}.
Json program_json(const StepProgram& program);

}  // namespace mop
