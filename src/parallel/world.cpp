// World initialisation: MPI (when launched by one), local rank from a shared-memory split so
// mpirun and srun agree, the host name for error messages.
#include "parallel/world.h"

#include <mpi.h>
#include <unistd.h>

#include <cstdlib>

#include "core/error.h"
#include "parallel/collective_log.h"
#include "parallel/inprocess_comm.h"
#include "parallel/launch.h"
#include "parallel/mesh.h"
#include "parallel/mpi_comm.h"
#include "parallel/standin_comm.h"

namespace mop {

World World::init(int* argc, char*** argv) {
  World w;
  char host[256] = {};
  gethostname(host, sizeof host - 1);
  w.host = host;
  if (launched_by_mpi()) {
    int provided = 0;
    MPI_Init_thread(argc, argv, MPI_THREAD_FUNNELED, &provided);
    // Errors come back as return codes so they are reported through MOP_CHECK with context.
    MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
    w.mpi = true;
    MPI_Comm_rank(MPI_COMM_WORLD, &w.rank);
    MPI_Comm_size(MPI_COMM_WORLD, &w.size);
    MPI_Comm local;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, w.rank, MPI_INFO_NULL, &local);
    MPI_Comm_rank(local, &w.local_rank);
    MPI_Comm_size(local, &w.local_size);
    MPI_Comm_free(&local);
    w.comm = make_mpi_comm(MPI_COMM_WORLD);
  } else {
    w.comm = make_self_comm();
  }
  set_error_context("rank " + std::to_string(w.rank) + " on " + w.host);
  return w;
}

namespace {

std::unique_ptr<CommFactory> carrier_factory(const World& world) {
  if (world.mpi) return make_mpi_comm_factory();
  if (world.inprocess) return make_inprocess_comm_factory(world.inprocess, world.rank);
  if (world.standin) return make_standin_comm_factory(world.standin);
  MOP_CHECK(world.size == 1, "a world of ", world.size, " ranks without MPI");
  return make_self_comm_factory();
}

}  // namespace

std::unique_ptr<CommFactory> make_comm_factory(const World& world) {
  std::unique_ptr<CommFactory> f = carrier_factory(world);
  return world.collective_log ? record_collectives(std::move(f), *world.collective_log) : std::move(f);
}

World inprocess_world(std::shared_ptr<InProcessWorld> ranks, int rank, int size) {
  World w;
  w.rank = rank, w.size = size, w.local_rank = rank, w.local_size = size;
  w.host = "in-process";
  w.inprocess = std::move(ranks);
  w.comm = make_inprocess_comm_factory(w.inprocess, rank)->host(world_group(size, rank));
  return w;
}

void World::finalize() {
  comm.reset();
  if (mpi) {
    MPI_Finalize();
    mpi = false;
  }
}

void World::abort(int code) {
  if (mpi && size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  std::exit(code);
}

}  // namespace mop
