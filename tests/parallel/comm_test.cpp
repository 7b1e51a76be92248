// Comm over MPI on CPU ranks (run under mpirun -np 2 and -np 4) and over in-process ranks: every
// collective checked exactly with payloads that encode the source rank and element index
// (collective_checks.h).
#include <mpi.h>

#include "catch.h"
#include "parallel/collective_checks.h"
#include "parallel/inprocess_comm.h"
#include "parallel/mpi_comm.h"

using namespace mop;
using namespace mop::test;

TEST_CASE("comm: MPI collectives move exactly what they should", "[mpi]") {
  auto comm = make_mpi_comm(MPI_COMM_WORLD);
  REQUIRE(comm->size() >= 2);
  for (const CollectiveCheck& check : collective_checks()) SECTION(check.name) check.run(*comm);
}

TEST_CASE("comm: in-process collectives move exactly what they should", "[cpu]") {
  for (int R : {2, 3, 4, 5}) {
    INFO(R << " in-process ranks");
    std::vector<std::unique_ptr<Comm>> comms = make_inprocess_comms(R);
    REQUIRE(comms[1]->size() == R);
    CHECK(comms[1]->rank() == 1);
    CHECK(comms[1]->name() == "inprocess");
    run_inprocess(R, [&](int rank) {
      for (const CollectiveCheck& check : collective_checks()) check.run(*comms[size_t(rank)]);
    });
  }
}
