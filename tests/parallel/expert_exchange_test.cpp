// The bounded expert exchange (exchange_checks.h) on 2, 3 and 4 in-process ranks: receive
// buffers from one row to the worst case, results bit for bit those of the worst case's buffers.
#include "catch.h"
#include "ops/ops.h"
#include "parallel/exchange_checks.h"
#include "parallel/inprocess_comm.h"

using namespace mop;

TEST_CASE("expert exchange in rounds equals the unbounded exchange bit for bit", "[cpu][exchange]") {
  for (int R : {2, 3, 4}) {
    INFO(R << " in-process ranks");
    std::vector<std::unique_ptr<Comm>> comms = make_inprocess_comms(R);
    run_inprocess(R, [&](int rank) {
      auto ops = make_cpu_ops();
      test::check_bounded_exchange(*comms[size_t(rank)], *ops);
    });
  }
}
