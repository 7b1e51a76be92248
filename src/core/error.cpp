// Error formatting: internal failures carry the statement, file:line and the rank/host context.
#include "core/error.h"

namespace mop {
namespace {
std::string& context_storage() {
  static std::string context;
  return context;
}
}  // namespace

std::string printable(std::string_view text) {
  static const char* kHex = "0123456789abcdef";
  std::string out;
  out.reserve(text.size());
  auto hex = [&](const char* prefix, unsigned char c) {
    out += prefix;
    out += kHex[c >> 4];
    out += kHex[c & 15];
  };
  for (size_t i = 0; i < text.size();) {
    const auto c = static_cast<unsigned char>(text[i]);
    if (c < 0x80) {
      if (c == '\n')
        out += "\\n";
      else if (c == '\t')
        out += "\\t";
      else if (c == '\r')
        out += "\\r";
      else if (c < 0x20 || c == 0x7f)
        hex("\\x", c);
      else
        out += char(c);
      ++i;
      continue;
    }
    // A well-formed UTF-8 sequence (no overlongs, surrogates or code points past U+10FFFF) is
    // kept, except the C1 controls U+0080..U+009F (0xc2 0x80..0x9f; U+009B is a CSI).
    const size_t len = c >= 0xf0 ? 4 : c >= 0xe0 ? 3 : c >= 0xc2 ? 2 : 0;
    bool ok = len > 0 && c <= 0xf4 && i + len <= text.size();
    for (size_t k = 1; ok && k < len; ++k)
      ok = (static_cast<unsigned char>(text[i + k]) & 0xc0) == 0x80;
    if (ok && len >= 3) {
      const auto c1 = static_cast<unsigned char>(text[i + 1]);
      ok = !(c == 0xe0 && c1 < 0xa0) && !(c == 0xed && c1 >= 0xa0) && !(c == 0xf0 && c1 < 0x90) &&
           !(c == 0xf4 && c1 >= 0x90);
    }
    if (!ok) {
      hex("\\x", c);
      ++i;
    } else if (c == 0xc2 && static_cast<unsigned char>(text[i + 1]) < 0xa0) {
      hex("\\u00", static_cast<unsigned char>(text[i + 1]));
      i += 2;
    } else {
      out.append(text.substr(i, len));
      i += len;
    }
  }
  return out;
}

void set_error_context(std::string context) {
  context_storage() = std::move(context);
}
const std::string& error_context() {
  return context_storage();
}

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
  throw Error(printable(os.str()));
}
}  // namespace detail
}  // namespace mop
