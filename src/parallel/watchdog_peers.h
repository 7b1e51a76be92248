// WatchdogPeers: the side channel over which the collective watchdogs of a job learn which ranks
// did not arrive at a collective that timed out. Every rank serves its watchdog's state (how many
// collectives it has begun, whether one is in flight, its name, since when) on a TCP port of its
// own, opened by a background thread that answers whatever the rank's main thread is doing; the
// ranks' addresses are exchanged once over MPI. A watchdog that fires asks every peer at once and
// names those that answer with an earlier collective, or do not answer at all (a stopped process:
// its kernel accepts the connection, nobody writes), in its one error line.
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <thread>
#include <vector>

namespace mop {

// A rank's watchdog state as its peers see it.
struct WatchdogState {
  uint64_t seq = 0;       // collectives begun so far (the one in flight included)
  bool in_flight = false;
  double age_s = 0;       // in flight: for how long; otherwise: since the last one ended (or start)
  std::string what;       // the in-flight collective's name, or the last one's ("" before any)
};

std::string encode_watchdog_state(const WatchdogState& s);  // one line, '\n'-terminated
std::optional<WatchdogState> decode_watchdog_state(const std::string& line);

// Where a rank can be reached, and what identifies it in a message.
struct PeerEndpoint {
  std::string host;
  int pid = 0;
  uint16_t port = 0;
  std::vector<uint32_t> ipv4;  // network byte order; tried in order (loopback first on one host)
};

// The clause of the watchdog's error line after "did not finish within T s; " for the rank
// `self` waiting in collective number `seq`: which ranks did not arrive and what each is doing
// (outside collectives, never begun one, no answer), then the ranks still inside an earlier
// collective, which are most often waiting for the former (they are named first only when no rank
// of the former kind is late), or that every rank reached it.
// states[r] is rank r's answer (nullopt: none within the query deadline); states[self] is ignored.
std::string describe_stragglers(int self, uint64_t seq, const std::vector<PeerEndpoint>& peers,
                                const std::vector<std::optional<WatchdogState>>& states);

class WatchdogPeers {
 public:
  using StateFn = std::function<WatchdogState()>;

  // Collective over MPI_COMM_WORLD, from the thread that runs MPI: opens this rank's port, starts
  // the thread that answers on it with state(), and gathers every rank's endpoint. When the port
  // cannot be opened or the ranks cannot reach each other (tried once, rank r asking rank r+1),
  // error() says why and the watchdog reports without peer states.
  explicit WatchdogPeers(StateFn state);
  ~WatchdogPeers();
  WatchdogPeers(const WatchdogPeers&) = delete;
  WatchdogPeers& operator=(const WatchdogPeers&) = delete;

  int rank() const { return rank_; }
  const std::vector<PeerEndpoint>& endpoints() const { return endpoints_; }
  const std::string& error() const { return error_; }

  // Asks every other rank at once; waits at most deadline_s. Any thread.
  std::vector<std::optional<WatchdogState>> query(double deadline_s) const;

 private:
  void serve();
  std::vector<std::optional<WatchdogState>> ask(const std::vector<int>& ranks,
                                                double deadline_s) const;

  StateFn state_;
  int rank_ = 0;
  int listen_fd_ = -1;
  int wake_pipe_[2] = {-1, -1};
  std::vector<PeerEndpoint> endpoints_;
  std::string error_;
  std::thread thread_;
};

}  // namespace mop
