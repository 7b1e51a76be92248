// In-process ranks: N ranks as threads of one process, exchanging host tensors through shared
// memory — the whole Comm interface and a CommFactory over any mesh, so distributed code runs and
// is checked in one process, without MPI. Blocking, like MpiComm: a collective returns when this
// rank's part is done; a send returns once its tensor is copied, a recv once its message arrived
// (or after kInProcessWaitS without one: an Error).
//
// Sums (all_reduce_sum, reduce_scatter_sum, all_reduce_host Sum) add the ranks' values in group
// rank order, ((x0 + x1) + x2) + …, the same on every rank. With 2 ranks that is bitwise what any
// MPI gives (x0 + x1 = x1 + x0 exactly); with more, Open MPI's order depends on its algorithm
// (recursive doubling, ring segments) and floats can differ in the last bits, integers cannot
// (Open MPI 4.1.4 on 1009 random floats: 3 ranks matched bitwise, 4, 5 and 8 did not).
#pragma once

#include <functional>
#include <memory>
#include <vector>

#include "parallel/comm_factory.h"
#include "runtime/comm.h"

namespace mop {

// The rendezvous of every group's comms among `num_ranks` in-process ranks.
class InProcessWorld;
std::shared_ptr<InProcessWorld> make_inprocess_world(int num_ranks);

// Rank `rank`'s comms. Making a comm does not wait for the other ranks (one thread may make every
// rank's); its collectives do. A comm refers to its group's rendezvous, not to the factory.
std::unique_ptr<CommFactory> make_inprocess_comm_factory(std::shared_ptr<InProcessWorld> world,
                                                         int rank);

// One world comm per rank, element r for rank r.
std::vector<std::unique_ptr<Comm>> make_inprocess_comms(int num_ranks);

// Runs fn(rank) for every rank, each on a thread of its own, and waits for all; then rethrows the
// first rank's error, if any. A rank that throws leaves the others waiting in their next collective
// until it times out (kInProcessWaitS), so they fail too instead of hanging.
void run_inprocess(int num_ranks, const std::function<void(int rank)>& fn);

// Seconds a rank waits for the others at a collective, or for a message, before it throws.
constexpr double kInProcessWaitS = 60;

}  // namespace mop
