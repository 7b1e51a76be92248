// Error formatting: internal failures carry the statement, file:line and the rank/host context.
#include "core/error.h"

namespace mop {
namespace {
std::string& context_storage() {
  static std::string context;
  return context;
}
}  // namespace

void set_error_context(std::string context) { context_storage() = std::move(context); }
const std::string& error_context() { return context_storage(); }

namespace detail {
void fail(const char* kind, const char* expr, const char* file, int line,
          const std::string& message) {
  std::ostringstream os;
  os << kind;
  if (expr && *expr) os << ": " << expr;
  if (!message.empty()) os << " — " << message;
  os << " (" << file << ":" << line;
  if (!error_context().empty()) os << ", " << error_context();
  os << ")";
  throw Error(os.str());
}
}  // namespace detail
}  // namespace mop
