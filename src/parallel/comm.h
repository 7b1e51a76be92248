// Comm: the collectives the trainer needs, over one group of ranks. Implementations: SelfComm
// (one rank, no MPI), MpiComm (host buffers over MPI; lets CI run multi-rank tests on CPU ranks),
// and later NcclComm (device buffers). Every call is collective over the group (send_recv: over the ranks it pairs) and blocking.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/tensor.h"

namespace mop {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;

  // x = Σ over ranks (in place).
  virtual void all_reduce_sum(Tensor x) = 0;
  // out [size·n] = concatenation of every rank's in [n], in rank order.
  virtual void all_gather(Tensor out, const Tensor& in) = 0;
  // out [n] = Σ over ranks of chunk `rank` of in [size·n].
  virtual void reduce_scatter_sum(Tensor out, const Tensor& in) = 0;
  // Variable all-to-all over rows: send_counts[r] rows of `in` (consecutive, in rank order) go to
  // rank r; recv_counts[r] rows arrive from rank r into `out` in rank order. Rows have the same
  // width on every rank.
  virtual void all_to_all_v(Tensor out, const std::vector<int64_t>& recv_counts, const Tensor& in,
                            const std::vector<int64_t>& send_counts) = 0;
  // Point-to-point shift (a ring step): sends `in` to rank `dst` and receives `out` (the same
  // number of bytes) from rank `src`, both at once, so every rank of a ring can call it together.
  virtual void send_recv(Tensor out, int src, const Tensor& in, int dst) = 0;
  virtual void broadcast(Tensor x, int root) = 0;
  virtual void barrier() = 0;

  // Host-side reductions of a few values (metrics, token counts, agreement checks). Doubles hold
  // integers up to 2^53 exactly.
  enum class Op { Sum, Max, Min };
  virtual void all_reduce_host(double* values, int n, Op op) = 0;
  double all_reduce_host(double v, Op op) {
    all_reduce_host(&v, 1, op);
    return v;
  }
  // True on every rank when every rank passed the same string (e.g. the resolved config).
  bool all_equal(const std::string& s);
};

std::unique_ptr<Comm> make_self_comm();

}  // namespace mop
