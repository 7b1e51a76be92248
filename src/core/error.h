// One error vocabulary for the whole project.
//   UserError  — bad input (config, data, checkpoint, flag): one clear line, exit code 2.
//   Error      — a bug or a failing system call/library: statement, file:line, rank and host.
// MOP_CHECK / MOP_USER_CHECK stream their message parts, so this header needs no fmt and can be
// included from .cu files.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>

namespace mop {

// `text` with every control character written out — "\x1b", "\n", "\u009b" (C1), "\xff" (a byte
// that is not UTF-8) — and the rest, UTF-8 included, as it is. Messages echo what the user wrote
// (config keys and values, paths, flags); escaped, a value cannot clear the terminal, move the
// cursor or forge a second line. Escaped text comes back unchanged, so escaping twice is harmless.
std::string printable(std::string_view text);

// Raised for problems the user can fix; main() prints "error: <what>" and exits with code 2. The
// message is made printable here, so every user error is, whoever built it.
class UserError : public std::runtime_error {
 public:
  explicit UserError(const std::string& what) : std::runtime_error(printable(what)) {}
};

// Raised for internal failures; the message already names the statement and its location.
class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

// "rank R on HOST" once the world is known (empty before); appended to internal errors.
void set_error_context(std::string context);
const std::string& error_context();

namespace detail {
template <class... Args>
std::string concat(Args&&... args) {
  std::ostringstream os;
  (os << ... << std::forward<Args>(args));
  return os.str();
}
[[noreturn]] void fail(const char* kind, const char* expr, const char* file, int line,
                       const std::string& message);
}  // namespace detail

template <class... Args>
[[noreturn]] void throw_user_error(Args&&... args) {
  throw UserError(detail::concat(std::forward<Args>(args)...));
}

}  // namespace mop

// Internal invariant; message parts are streamed: MOP_CHECK(n > 0, "n=", n).
#define MOP_CHECK(cond, ...)                                                              \
  do {                                                                                    \
    if (!(cond)) [[unlikely]]                                                             \
      ::mop::detail::fail("check failed", #cond, __FILE__, __LINE__,                      \
                          ::mop::detail::concat("" __VA_OPT__(, ) __VA_ARGS__));          \
  } while (0)

// User-facing precondition: throws UserError with exactly the given message.
#define MOP_USER_CHECK(cond, ...)                                           \
  do {                                                                      \
    if (!(cond)) [[unlikely]]                                               \
      throw ::mop::UserError(::mop::detail::concat(__VA_ARGS__));           \
  } while (0)

#define MOP_UNREACHABLE(...) \
  ::mop::detail::fail("unreachable", "", __FILE__, __LINE__, ::mop::detail::concat("" __VA_OPT__(, ) __VA_ARGS__))
