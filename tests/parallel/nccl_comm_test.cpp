// [gpu] NcclComm on device buffers, checked exactly: integer payloads that encode the source rank
// and element (exact in every dtype, so sums compare with ==), outputs poisoned before each call
// and guard elements after them. Runs with one rank (no mpirun: a group of one without MPI; the
// H200 machine has one GPU) and with N ranks under mpirun (MPI bootstrap), one GPU per local rank.
#ifdef MOP_HAVE_CUDA

#include <cuda_runtime.h>
#include <mpi.h>

#include <cstring>
#include <functional>
#include <vector>

#include "catch.h"
#include "gpu/gpu_test_util.h"
#include "parallel/mpi_comm.h"
#include "runtime/nccl_comm.h"
#include "parallel/watchdog.h"

using namespace mop;
using namespace mop::test;

namespace {

// Elements after every output that no collective may write.
constexpr int64_t kGuard = 3;

struct Group {
  MPI_Comm comm = MPI_COMM_NULL;
  std::unique_ptr<Comm> host;  // bootstraps the NCCL comms: MPI over `comm`, or a self comm
  int local_rank = 0, local_size = 1;
};

// MPI_COMM_WORLD when the binary runs under mpirun; otherwise a group of one without MPI.
// (Initialising MPI here as a singleton would leave PMIX_RANK in the environment, which
// launched_by_mpi() reads, and change what later tests in this process do.)
Group test_group() {
  int initialized = 0, finalized = 0;
  MPI_Initialized(&initialized);
  MPI_Finalized(&finalized);
  Group g;
  g.host = make_self_comm();
  if (!initialized || finalized) return g;
  g.comm = MPI_COMM_WORLD;
  g.host = make_mpi_comm(g.comm);
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm local;
  MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &local);
  MPI_Comm_rank(local, &g.local_rank);
  MPI_Comm_size(local, &g.local_size);
  MPI_Comm_free(&local);
  return g;
}

struct CudaStream {
  cudaStream_t s = nullptr;
  CudaStream() { MOP_CUDA_CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking)); }
  ~CudaStream() { cudaStreamDestroy(s); }
};

template <class T>
double load(const void* p) {
  T v;
  std::memcpy(&v, p, sizeof v);
  return double(v);
}

// Element i of a host byte buffer of `dtype`, as a double (every value used here is exact).
double get(const std::vector<uint8_t>& h, DType dtype, int64_t i) {
  const void* p = h.data() + size_t(i) * dtype_size(dtype);
  switch (dtype) {
    case DType::F32:
      return load<float>(p);
    case DType::F64:
      return load<double>(p);
    case DType::BF16:
      return bf16_to_float(bf16{uint16_t(load<uint16_t>(p))});
    case DType::I32:
      return load<int32_t>(p);
    case DType::I64:
      return load<int64_t>(p);
    case DType::U8:
      return load<uint8_t>(p);
    case DType::U16:
      return load<uint16_t>(p);
    case DType::U32:
      return load<uint32_t>(p);
  }
  return 0;
}

void put(std::vector<uint8_t>& h, DType dtype, int64_t i, double x) {
  void* p = h.data() + size_t(i) * dtype_size(dtype);
  auto store = [p](auto v) { std::memcpy(p, &v, sizeof v); };
  switch (dtype) {
    case DType::F32:
      store(float(x));
      break;
    case DType::F64:
      store(x);
      break;
    case DType::BF16:
      store(float_to_bf16(float(x)));
      break;
    case DType::I32:
      store(int32_t(x));
      break;
    case DType::I64:
      store(int64_t(x));
      break;
    case DType::U8:
      store(uint8_t(x));
      break;
    case DType::U16:
      store(uint16_t(x));
      break;
    case DType::U32:
      store(uint32_t(x));
      break;
  }
}

// A device tensor of `rows` × `width` (1-d when width is 0) followed by kGuard poisoned elements;
// `t` views the tensor without the guard.
struct Guarded {
  DeviceTensor buf;
  Tensor t;
  Guarded(DType dtype, int64_t rows, int64_t width = 0) {
    int64_t n = rows * (width ? width : 1);
    buf = DeviceTensor(dtype, {n + kGuard});
    poison(buf);
    t = width ? Tensor(buf.t.data, dtype, {rows, width}, Device::CUDA)
              : Tensor(buf.t.data, dtype, {rows}, Device::CUDA);
  }
  void upload(const std::function<double(int64_t)>& value) {
    std::vector<uint8_t> h(t.bytes());
    for (int64_t i = 0; i < t.numel(); ++i) put(h, t.dtype, i, value(i));
    MOP_CUDA_CHECK(cudaMemcpy(t.data, h.data(), h.size(), cudaMemcpyHostToDevice));
    MOP_CUDA_CHECK(cudaDeviceSynchronize());  // the comm's non-blocking stream does not wait for it
  }
  // Host bytes of the tensor and its guard, after the stream's work.
  std::vector<uint8_t> download(cudaStream_t stream) const {
    MOP_CUDA_CHECK(cudaStreamSynchronize(stream));
    std::vector<uint8_t> h(buf.t.bytes());
    MOP_CUDA_CHECK(cudaMemcpy(h.data(), buf.t.data, h.size(), cudaMemcpyDeviceToHost));
    return h;
  }
  // Elements that differ from expect(i), plus guard elements that were written.
  int64_t wrong(cudaStream_t stream, const std::function<double(int64_t)>& expect) const {
    std::vector<uint8_t> h = download(stream);
    int64_t bad = 0;
    for (int64_t i = 0; i < t.numel(); ++i) bad += !(get(h, t.dtype, i) == expect(i));
    size_t e = dtype_size(t.dtype);
    for (size_t b = t.bytes(); b < t.bytes() + size_t(kGuard) * e; ++b) bad += h[b] != 0xFF;
    return bad;
  }
};

}  // namespace

TEST_CASE("nccl comm: collectives on device buffers move exactly what they should", "[gpu]") {
  if (!gpu_available()) {
    WARN("no CUDA device: skipped");
    return;
  }
  Group g = test_group();
  int num_devices = 0;
  MOP_CUDA_CHECK(cudaGetDeviceCount(&num_devices));
  if (g.local_size > num_devices) {
    WARN("more ranks on this host than GPUs (" << g.local_size << " > " << num_devices
                                               << "): skipped");
    return;
  }
  MOP_CUDA_CHECK(cudaSetDevice(g.local_rank));
  CudaStream stream;
  auto comm = make_nccl_comm(*g.host, Stream::wrap(Device::CUDA, stream.s));
  const int R = comm->size(), me = comm->rank();
  CHECK(comm->name() == "nccl");
  if (g.comm == MPI_COMM_NULL) CHECK(R == 1);

  SECTION("all_reduce_sum in every summed dtype, sizes 1, prime, large") {
    // Values per dtype: wide enough to catch a truncating type, small enough that every partial
    // sum is exact with up to 8 ranks (bf16: |Σ| ≤ 8·12 + 28 < 256).
    struct Case {
      DType dtype;
      std::function<double(int, int64_t)> value;
    };
    const Case cases[] = {
        {DType::F32, [](int r, int64_t i) { return double((i % 1000) * 4 + r); }},
        {DType::BF16, [](int r, int64_t i) { return double(i % 13 + r); }},
        {DType::F64, [](int r, int64_t i) { return double(i) * 1048576.0 + r + 0.5; }},
        {DType::I32, [](int r, int64_t i) { return double(i * 8 + r - 1000000); }},
        {DType::I64, [](int r, int64_t i) { return double(((i % 65536) << 30) + r); }},
    };
    for (const Case& c : cases)
      for (int64_t n : {int64_t(1), int64_t(7), int64_t(65537), int64_t(1) << 20}) {
        Guarded x(c.dtype, n);
        x.upload([&](int64_t i) { return c.value(me, i); });
        comm->all_reduce_sum(x.t);
        INFO(dtype_name(c.dtype) << " n=" << n);
        CHECK(x.wrong(stream.s, [&](int64_t i) {
          double s = 0;
          for (int r = 0; r < R; ++r) s += c.value(r, i);
          return s;
        }) == 0);
      }
    Guarded u8(DType::U8, 4);
    CHECK_THROWS_AS(comm->all_reduce_sum(u8.t), Error);
  }

  SECTION("all_gather of any dtype (bytes)") {
    for (DType dtype : {DType::I32, DType::U8, DType::BF16})
      for (int64_t n : {1, 13, 4097}) {
        auto value = [](int r, int64_t i) { return double((r * 37 + i) % 200); };
        Guarded in(dtype, n), out(dtype, R * n);
        in.upload([&](int64_t i) { return value(me, i); });
        comm->all_gather(out.t, in.t);
        INFO(dtype_name(dtype) << " n=" << n);
        CHECK(out.wrong(stream.s, [&](int64_t i) { return value(int(i / n), i % n); }) == 0);
      }
  }

  SECTION("reduce_scatter_sum") {
    for (DType dtype : {DType::F32, DType::BF16, DType::I64})
      for (int64_t n : {1, 7, 4099}) {
        auto value = [](int r, int64_t j) { return double(j % 11 + r); };
        Guarded in(dtype, R * n), out(dtype, n);
        in.upload([&](int64_t j) { return value(me, j); });
        comm->reduce_scatter_sum(out.t, in.t);
        INFO(dtype_name(dtype) << " n=" << n);
        CHECK(out.wrong(stream.s, [&](int64_t i) {
          double s = 0;
          for (int r = 0; r < R; ++r) s += value(r, me * n + i);
          return s;
        }) == 0);
      }
  }

  SECTION("all_to_all_v: rows of 10 and 24 bytes, variable counts, a rank that receives nothing") {
    // Rank s sends count(s, d) rows to rank d; with several ranks nobody sends to the last one.
    auto count = [R](int s, int d) { return R > 1 && d == R - 1 ? 0 : 1 + (s + 2 * d) % 4; };
    // Element c of row j from s to d: fits u16 for R ≤ 16 (j < 4, c < 8).
    auto code = [](int s, int d, int64_t j, int64_t c) {
      return double(((s * 16 + d) * 8 + j) * 8 + c);
    };
    struct Rows {
      DType dtype;
      int64_t width;
    };
    for (Rows rows : {Rows{DType::U16, 5}, Rows{DType::F64, 3}}) {
      const DType dtype = rows.dtype;
      const int64_t width = rows.width;
      std::vector<int64_t> send(R), recv(R);
      int64_t ns = 0, nr = 0;
      for (int d = 0; d < R; ++d) ns += send[d] = count(me, d);
      for (int s = 0; s < R; ++s) nr += recv[s] = count(s, me);
      // Row owners of the flat send and receive buffers.
      std::vector<int> send_to, recv_from;
      std::vector<int64_t> send_j, recv_j;
      for (int d = 0; d < R; ++d)
        for (int64_t j = 0; j < send[d]; ++j) send_to.push_back(d), send_j.push_back(j);
      for (int s = 0; s < R; ++s)
        for (int64_t j = 0; j < recv[s]; ++j) recv_from.push_back(s), recv_j.push_back(j);
      Guarded in(dtype, ns + 1, width), out(dtype, nr, width);  // a spare input row: never sent
      in.upload([&](int64_t e) {
        int64_t row = e / width, c = e % width;
        return row < ns ? code(me, send_to[row], send_j[row], c) : 7.0;
      });
      comm->all_to_all_v(out.t, recv, in.t, send);
      INFO(dtype_name(dtype) << " rows sent " << ns << ", received " << nr);
      CHECK(out.wrong(stream.s, [&](int64_t e) {
        int64_t row = e / width, c = e % width;
        return code(recv_from[row], me, recv_j[row], c);
      }) == 0);
      if (R > 1 && me == R - 1) CHECK(nr == 0);
    }
    // Nothing to move at all, into a buffer of zero rows.
    Guarded empty_in(DType::I32, 2, 4), empty_out(DType::I32, 0, 4);
    comm->all_to_all_v(empty_out.t, std::vector<int64_t>(R, 0), empty_in.t,
                       std::vector<int64_t>(R, 0));
    CHECK(empty_out.wrong(stream.s, [](int64_t) { return 0.0; }) == 0);
    // Preconditions fail on every rank alike, before anything is enqueued.
    Guarded small(DType::I32, 1, 4);
    CHECK_THROWS_AS(comm->all_to_all_v(small.t, std::vector<int64_t>(R, 2), small.t,
                                       std::vector<int64_t>(R, 2)),
                    Error);
    Guarded both(DType::I32, R, 4);
    CHECK_THROWS_AS(
        comm->all_to_all_v(both.t, std::vector<int64_t>(R, 1), both.t, std::vector<int64_t>(R, 1)),
        Error);
  }

  SECTION("asynchronous comm: all_to_all_v at given rows, after the compute stream, joined") {
    // Its own stream, following the compute stream: the input is written on the compute stream
    // just before the collective (asynchronously, from pinned memory) and the result is read
    // there right after join(); a collective that did not wait, or a join that did not, would
    // show stale rows. Large rows make such a race visible. Rank s sends one row to rank d from
    // row R−1−d and receives rank s's at row 2·(R−1−s); the rows between stay untouched.
    CudaStream side;
    auto async = make_nccl_comm(*g.host, Stream::wrap(Device::CUDA, side.s), Stream::wrap(Device::CUDA, stream.s));
    const int64_t W = int64_t(1) << 16;
    auto code = [&](int s, int d, int64_t c) { return double((int64_t(s) * 16 + d) * W + c); };
    Guarded in(DType::U32, R, W), out(DType::U32, 2 * R, W);
    uint32_t* host = nullptr;
    MOP_CUDA_CHECK(cudaMallocHost(&host, size_t(R * W) * sizeof(uint32_t)));
    for (int d = 0; d < R; ++d)
      for (int64_t c = 0; c < W; ++c) host[(R - 1 - d) * W + c] = uint32_t(code(me, d, c));
    std::vector<int64_t> one(R, 1), send_at(R), recv_at(R);
    for (int r = 0; r < R; ++r) send_at[r] = R - 1 - r, recv_at[r] = 2 * (R - 1 - r);
    MOP_CUDA_CHECK(cudaMemcpyAsync(in.t.data, host, in.t.bytes(), cudaMemcpyHostToDevice, stream.s));
    async->all_to_all_v(out.t, one, recv_at, in.t, one, send_at);
    async->join();
    CHECK(out.wrong(stream.s, [&](int64_t e) {  // synchronises the compute stream only
      const int64_t row = e / W, c = e % W;
      return row % 2 ? 4294967295.0 : code(R - 1 - int(row / 2), me, c);
    }) == 0);
    MOP_CUDA_CHECK(cudaFreeHost(host));
  }

  SECTION("send_recv around the ring (to self on one rank)") {
    for (int shift : {1, R - 1}) {
      const int dst = (me + shift) % R, src = (me - shift + R) % R;
      for (int64_t n : {1, 4099}) {
        Guarded in(DType::BF16, n), out(DType::BF16, n);
        in.upload([&](int64_t i) { return double((me * 31 + shift * 7 + i) % 200); });
        comm->send_recv(out.t, src, in.t, dst);
        INFO("shift " << shift << " n=" << n);
        CHECK(out.wrong(stream.s, [&](int64_t i) { return double((src * 31 + shift * 7 + i) % 200); }) == 0);
      }
    }
    Guarded a(DType::F32, 4), b(DType::F32, 5);
    CHECK_THROWS_AS(comm->send_recv(b.t, 0, a.t, 0), Error);
  }

  SECTION("broadcast from the last rank") {
    const int root = R - 1;
    for (DType dtype : {DType::I64, DType::BF16}) {
      Guarded x(dtype, 5);
      x.upload([&](int64_t i) { return me == root ? double(42 + i) : double(me + 1); });
      comm->broadcast(x.t, root);
      CHECK(x.wrong(stream.s, [](int64_t i) { return double(42 + i); }) == 0);
    }
    Guarded x(DType::F32, 1);
    CHECK_THROWS_AS(comm->broadcast(x.t, R), Error);
  }

  SECTION("barrier waits for the stream; host reductions; agreement; watched") {
    Guarded x(DType::F32, 1 << 20);
    x.upload([&](int64_t i) { return double(i % 100 + me); });
    comm->all_reduce_sum(x.t);
    comm->barrier();
    // A plain copy, no stream sync: the barrier already waited for the all-reduce.
    std::vector<float> h(size_t(x.t.numel()));
    MOP_CUDA_CHECK(cudaMemcpy(h.data(), x.t.data, x.t.bytes(), cudaMemcpyDeviceToHost));
    int64_t bad = 0;
    for (int64_t i = 0; i < x.t.numel(); ++i)
      bad += h[size_t(i)] != float(R * (i % 100) + R * (R - 1) / 2);
    CHECK(bad == 0);

    CHECK(comm->all_reduce_host(double(me), Comm::Op::Max) == R - 1);
    CHECK(comm->all_reduce_host(double(me), Comm::Op::Min) == 0);
    CHECK(comm->all_reduce_host(1.0, Comm::Op::Sum) == R);
    CHECK(comm->all_equal("same"));
    if (R > 1) CHECK_FALSE(comm->all_equal(me == 0 ? "a" : "b"));

    CollectiveWatchdog dog(kDefaultCollectiveTimeoutS);
    auto watched = watch(std::move(comm), dog);
    Guarded y(DType::I32, 3);
    y.upload([&](int64_t i) { return double(i + me); });
    watched->all_reduce_sum(y.t);
    CHECK(y.wrong(stream.s, [&](int64_t i) { return double(R * i + R * (R - 1) / 2); }) == 0);
    CHECK(dog.num_collectives() == 1);
    CHECK_FALSE(dog.in_flight());
  }
}

#endif  // MOP_HAVE_CUDA
