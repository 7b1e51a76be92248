// The side channel is plain TCP: a listening socket on an ephemeral port of every address, served
// by a thread that writes one state line per connection and closes it; a query connects to every
// peer with non-blocking sockets and one poll() loop, so a job of many ranks is asked in one
// round trip and a silent peer costs the deadline, not more.
#include "parallel/watchdog_peers.h"

#include <arpa/inet.h>
#include <fcntl.h>
#include <ifaddrs.h>
#include <mpi.h>
#include <net/if.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <sstream>

#include <spdlog/spdlog.h>

namespace mop {
namespace {

constexpr int kMaxAddresses = 8;
constexpr size_t kMaxLine = 512;

// Fixed-size record of one rank's endpoint for MPI_Allgather.
struct EndpointRecord {
  char host[256];
  int32_t pid;
  uint16_t port;
  uint16_t num_ipv4;
  uint32_t ipv4[kMaxAddresses];
};

std::string errno_text(const char* what) { return std::string(what) + ": " + std::strerror(errno); }

// This host's IPv4 addresses that are up, loopback last (a peer on another host cannot use it;
// one on this host is sent to 127.0.0.1 first anyway).
std::vector<uint32_t> local_ipv4() {
  std::vector<uint32_t> out, loopback;
  ifaddrs* list = nullptr;
  if (getifaddrs(&list) == 0) {
    for (ifaddrs* a = list; a; a = a->ifa_next) {
      if (!a->ifa_addr || a->ifa_addr->sa_family != AF_INET || !(a->ifa_flags & IFF_UP)) continue;
      uint32_t ip = reinterpret_cast<sockaddr_in*>(a->ifa_addr)->sin_addr.s_addr;
      auto& dst = (a->ifa_flags & IFF_LOOPBACK) ? loopback : out;
      if (std::find(dst.begin(), dst.end(), ip) == dst.end()) dst.push_back(ip);
    }
    freeifaddrs(list);
  }
  out.insert(out.end(), loopback.begin(), loopback.end());
  if (out.size() > size_t(kMaxAddresses)) out.resize(kMaxAddresses);
  return out;
}

bool set_nonblocking(int fd) {
  int flags = fcntl(fd, F_GETFL, 0);
  return flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0;
}

std::string fmt_seconds(double s) {
  char buf[32];
  std::snprintf(buf, sizeof buf, s < 10 ? "%.1f" : "%.0f", s);
  return buf;
}

}  // namespace

std::string encode_watchdog_state(const WatchdogState& s) {
  std::ostringstream os;
  os << s.seq << ' ' << (s.in_flight ? 1 : 0) << ' ' << int64_t(std::llround(s.age_s * 1e3)) << ' '
     << s.what.substr(0, kMaxLine - 64) << '\n';
  return os.str();
}

std::optional<WatchdogState> decode_watchdog_state(const std::string& line) {
  WatchdogState s;
  unsigned long long seq = 0;
  int in_flight = 0, used = 0;
  long long age_ms = 0;
  if (std::sscanf(line.c_str(), "%llu %d %lld %n", &seq, &in_flight, &age_ms, &used) != 3 ||
      (in_flight != 0 && in_flight != 1) || age_ms < 0)
    return std::nullopt;
  s.seq = seq, s.in_flight = in_flight == 1, s.age_s = double(age_ms) * 1e-3;
  s.what = line.substr(size_t(used));
  while (!s.what.empty() && (s.what.back() == '\n' || s.what.back() == '\r')) s.what.pop_back();
  return s;
}

std::string describe_stragglers(int self, uint64_t seq, const std::vector<PeerEndpoint>& peers,
                                const std::vector<std::optional<WatchdogState>>& states) {
  // Late ranks fall in two groups: those that are not in any collective (silent, computing, or
  // never begun one) and those still inside an earlier collective. The second kind is usually
  // waiting for the first, so the first is named as the cause and the second after it.
  std::vector<int> late, waiting;
  std::vector<std::string> why, why_waiting;
  int silent = 0;
  for (int r = 0; r < int(states.size()); ++r) {
    if (r == self) continue;
    const auto& s = states[size_t(r)];
    if (s && s->seq >= seq) continue;  // at this collective (waiting too), or past it: it arrived
    if (s && s->in_flight) {
      waiting.push_back(r);
      why_waiting.push_back("has been in collective " + s->what + " (#" + std::to_string(s->seq) +
                            ") for " + fmt_seconds(s->age_s) + " s");
      continue;
    }
    std::string reason;
    if (!s) {
      reason = "does not answer (stopped, stuck in the kernel, or its node is down)";
      ++silent;
    } else if (s->seq == 0) {
      reason = "has begun no collective in " + fmt_seconds(s->age_s) + " s";
    } else {
      reason = "has been outside collectives for " + fmt_seconds(s->age_s) + " s, since " + s->what +
               " (#" + std::to_string(s->seq) + ") ended";
    }
    late.push_back(r);
    why.push_back(std::move(reason));
  }
  if (late.empty()) late.swap(waiting), why.swap(why_waiting);
  if (late.empty())
    return "every rank reached this collective (a stall in the network or on a device?)";
  auto who = [&](int r) {
    std::string w = "rank " + std::to_string(r);
    if (r < int(peers.size()))
      w += " (host " + peers[size_t(r)].host + ", pid " + std::to_string(peers[size_t(r)].pid) + ")";
    return w;
  };
  auto list = [&](std::ostringstream& os, const std::vector<int>& ranks) {
    for (size_t i = 0; i < ranks.size() && i < 8; ++i) os << (i ? ", " : "") << ranks[i];
    if (ranks.size() > 8) os << " and " << ranks.size() - 8 << " more";
  };
  std::ostringstream os;
  if (late.size() == 1) {
    os << who(late[0]) << " did not arrive: it " << why[0];
  } else {
    os << "ranks ";
    list(os, late);
    os << " did not arrive: ";
    for (size_t i = 0; i < late.size() && i < 8; ++i) os << (i ? "; " : "") << who(late[i]) << ' ' << why[i];
  }
  if (!waiting.empty()) {
    os << "; behind " << (late.size() == 1 ? "it" : "them") << ", still in an earlier collective: ";
    if (waiting.size() > 8) {
      os << "ranks ";
      list(os, waiting);
    } else {
      for (size_t i = 0; i < waiting.size(); ++i)
        os << (i ? "; " : "") << who(waiting[i]) << ' ' << why_waiting[i];
    }
  }
  if (silent == int(states.size()) - 1 && states.size() > 2)
    os << " (no rank answered: is TCP between the ranks blocked?)";
  return os.str();
}

WatchdogPeers::WatchdogPeers(StateFn state) : state_(std::move(state)) {
  int size = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank_);
  MPI_Comm_size(MPI_COMM_WORLD, &size);

  EndpointRecord mine{};
  gethostname(mine.host, sizeof mine.host - 1);
  mine.pid = int32_t(getpid());
  // Open the port and start answering before anyone learns of it: a peer may ask at once.
  listen_fd_ = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_ANY);
  socklen_t len = sizeof addr;
  if (listen_fd_ < 0)
    error_ = errno_text("socket");
  else if (bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), sizeof addr) != 0)
    error_ = errno_text("bind");
  else if (listen(listen_fd_, 256) != 0)
    error_ = errno_text("listen");
  else if (getsockname(listen_fd_, reinterpret_cast<sockaddr*>(&addr), &len) != 0)
    error_ = errno_text("getsockname");
  else if (pipe2(wake_pipe_, O_CLOEXEC) != 0)
    error_ = errno_text("pipe");
  if (error_.empty()) {
    mine.port = ntohs(addr.sin_port);
    std::vector<uint32_t> ips = local_ipv4();
    mine.num_ipv4 = uint16_t(ips.size());
    std::copy(ips.begin(), ips.end(), mine.ipv4);
    thread_ = std::thread([this] { serve(); });
  }

  std::vector<EndpointRecord> all(static_cast<size_t>(size));
  MPI_Allgather(&mine, int(sizeof mine), MPI_BYTE, all.data(), int(sizeof mine), MPI_BYTE,
                MPI_COMM_WORLD);
  endpoints_.resize(size_t(size));
  for (int r = 0; r < size; ++r) {
    const EndpointRecord& e = all[size_t(r)];
    PeerEndpoint& p = endpoints_[size_t(r)];
    p.host.assign(e.host, strnlen(e.host, sizeof e.host));
    p.pid = e.pid;
    p.port = e.port;
    if (p.host == mine.host) p.ipv4.push_back(htonl(INADDR_LOOPBACK));
    for (int i = 0; i < std::min<int>(e.num_ipv4, kMaxAddresses); ++i)
      if (std::find(p.ipv4.begin(), p.ipv4.end(), e.ipv4[i]) == p.ipv4.end())
        p.ipv4.push_back(e.ipv4[i]);
  }
  int ok = error_.empty() ? 1 : 0, all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (!all_ok && error_.empty()) error_ = "a peer could not open its port";
  if (error_.empty() && size > 1) {
    // One probe per rank (r asks r+1), so that blocked ports show now and not in a hang's report.
    const int next = (rank_ + 1) % size;
    if (!ask({next}, 5.0)[size_t(next)]) {
      error_ = "rank " + std::to_string(next) + " (host " + endpoints_[size_t(next)].host +
               ", port " + std::to_string(endpoints_[size_t(next)].port) + ") did not answer";
    }
  }
  if (!error_.empty())
    spdlog::warn("collective watchdog: no side channel between the ranks ({}); a hang will be "
                 "reported without naming the ranks that did not arrive", error_);
}

WatchdogPeers::~WatchdogPeers() {
  if (wake_pipe_[1] >= 0) {
    char c = 0;
    ssize_t n = write(wake_pipe_[1], &c, 1);
    (void)n;
  }
  if (thread_.joinable()) thread_.join();
  for (int fd : {listen_fd_, wake_pipe_[0], wake_pipe_[1]})
    if (fd >= 0) close(fd);
}

void WatchdogPeers::serve() {
  pollfd fds[2] = {{listen_fd_, POLLIN, 0}, {wake_pipe_[0], POLLIN, 0}};
  for (;;) {
    if (poll(fds, 2, -1) < 0) {
      if (errno == EINTR) continue;
      return;
    }
    if (fds[1].revents) return;
    if (!(fds[0].revents & POLLIN)) continue;
    int fd = accept4(listen_fd_, nullptr, nullptr, SOCK_CLOEXEC);
    if (fd < 0) continue;
    // A short line into an empty socket buffer: the write completes at once; never block on it.
    set_nonblocking(fd);
    std::string line = encode_watchdog_state(state_());
    ssize_t n = send(fd, line.data(), line.size(), MSG_NOSIGNAL);
    (void)n;
    close(fd);
  }
}

std::vector<std::optional<WatchdogState>> WatchdogPeers::query(double deadline_s) const {
  std::vector<int> others;
  for (int r = 0; r < int(endpoints_.size()); ++r)
    if (r != rank_) others.push_back(r);
  return ask(others, deadline_s);
}

std::vector<std::optional<WatchdogState>> WatchdogPeers::ask(const std::vector<int>& ranks,
                                                             double deadline_s) const {
  const int size = int(endpoints_.size());
  std::vector<std::optional<WatchdogState>> out(static_cast<size_t>(size));
  struct Ask {
    int fd = -1;
    size_t addr = 0;
    bool connected = false;
    std::string buf;
  };
  std::vector<Ask> asks(static_cast<size_t>(size));
  auto connect_next = [&](int r) {
    Ask& a = asks[size_t(r)];
    const PeerEndpoint& p = endpoints_[size_t(r)];
    while (a.addr < p.ipv4.size()) {
      int fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
      if (fd < 0) return;
      sockaddr_in sa{};
      sa.sin_family = AF_INET;
      sa.sin_port = htons(p.port);
      sa.sin_addr.s_addr = p.ipv4[a.addr++];
      if (connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof sa) == 0 || errno == EINPROGRESS) {
        a.fd = fd, a.connected = false;
        return;
      }
      close(fd);
    }
  };
  for (int r : ranks)
    if (endpoints_[size_t(r)].port != 0) connect_next(r);

  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(deadline_s);
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> who;
    for (int r = 0; r < size; ++r)
      if (asks[size_t(r)].fd >= 0) {
        fds.push_back({asks[size_t(r)].fd, short(asks[size_t(r)].connected ? POLLIN : POLLOUT), 0});
        who.push_back(r);
      }
    if (fds.empty()) break;
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    if (left.count() <= 0) break;
    int n = poll(fds.data(), nfds_t(fds.size()), int(left.count()));
    if (n < 0 && errno != EINTR) break;
    for (size_t i = 0; i < fds.size(); ++i) {
      if (!fds[i].revents) continue;
      const int r = who[i];
      Ask& a = asks[size_t(r)];
      if (!a.connected) {
        int err = 0;
        socklen_t len = sizeof err;
        getsockopt(a.fd, SOL_SOCKET, SO_ERROR, &err, &len);
        if (err != 0) {  // refused or unreachable there: the next address
          close(a.fd);
          a.fd = -1;
          connect_next(r);
        } else {
          a.connected = true;
        }
        continue;
      }
      char buf[256];
      ssize_t got = recv(a.fd, buf, sizeof buf, 0);
      if (got > 0) {
        a.buf.append(buf, size_t(got));
        if (a.buf.find('\n') == std::string::npos && a.buf.size() < kMaxLine) continue;
      } else if (got < 0 && (errno == EAGAIN || errno == EINTR)) {
        continue;
      }
      out[size_t(r)] = decode_watchdog_state(a.buf);
      close(a.fd);
      a.fd = -1;
    }
  }
  for (Ask& a : asks)
    if (a.fd >= 0) close(a.fd);
  return out;
}

}  // namespace mop
