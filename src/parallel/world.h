// World: this process's place in the job (rank, local rank, host) and the world communicator.
// Under mpirun/srun MPI is initialised; a plain process is rank 0 of 1 without MPI.
#pragma once

#include <memory>
#include <string>

#include "runtime/comm.h"

namespace mop {

class CollectiveLog;
class CommFactory;
class InProcessWorld;
struct StandInJob;

struct World {
  int rank = 0, size = 1;
  int local_rank = 0, local_size = 1;  // among the ranks on this host
  std::string host;
  bool mpi = false;
  std::unique_ptr<Comm> comm;  // all ranks
  // Tests: ranks that are threads of one process (parallel/inprocess_comm.h), without MPI.
  std::shared_ptr<InProcessWorld> inprocess;
  // An emulated rank (`mop emulate`, standin_comm.h): its groups' comms are stand-ins.
  std::shared_ptr<const StandInJob> standin;
  // Tests: every collective of the comms made for this rank's groups is recorded here
  // (collective_log.h). Not owned.
  CollectiveLog* collective_log = nullptr;

  // Initialises MPI when launched by an MPI launcher; sets the error context ("rank R on HOST").
  static World init(int* argc, char*** argv);
  // Ends the job: MPI_Finalize on success; on failure of one rank, MPI_Abort brings down the rest
  // instead of leaving them waiting in a collective.
  void finalize();
  [[noreturn]] void abort(int code);
  bool is_root() const { return rank == 0; }
};

// The comms of this job's groups (comm_factory.h): over MPI when MPI is initialised, in-process
// for a world of threads, stand-ins for an emulated rank, else the self comms of a world of one;
// recorded into world.collective_log when it is set.
std::unique_ptr<CommFactory> make_comm_factory(const World& world);
// Rank `rank` of an in-process world of threads (inprocess_comm.h): its World, world comm included.
World inprocess_world(std::shared_ptr<InProcessWorld> ranks, int rank, int size);

}  // namespace mop
