// TimedComm: a Comm decorator that counts every tensor collective as "communication" in TimedOps'
// time split. The data comms enqueue on the backend's stream (NCCL) or block (MPI), so the time
// measured there is communication the step waits for: exposed, not hidden behind compute. An
// asynchronous comm's collectives take no compute-stream time; its join() (the compute stream
// waiting for them) is what counts. Host reductions of a few values and barriers are forwarded
// untimed.
#pragma once

#include <memory>
#include <string>

#include "ops/timed_ops.h"
#include "runtime/comm.h"

namespace mop {

// `timed` must outlive the result. `label` names the comm in a trace's join entries.
std::unique_ptr<Comm> time_comm(std::unique_ptr<Comm> inner, TimedOps& timed,
                                const std::string& label);

}  // namespace mop
