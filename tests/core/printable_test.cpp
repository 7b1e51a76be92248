// printable: the escaping every error message gets — control characters written out, UTF-8 kept,
// stray bytes shown in hex, and escaping twice the same as once.
#include "catch.h"
#include "core/error.h"

using namespace mop;

TEST_CASE("printable: control characters are written out, text and UTF-8 kept", "[cpu][core]") {
  CHECK(printable("model.hidden_size: 'big'") == "model.hidden_size: 'big'");
  CHECK(printable("\x1b[2J\x1b]0;t\x07") == "\\x1b[2J\\x1b]0;t\\x07");
  CHECK(printable("a\nb\tc\rd") == "a\\nb\\tc\\rd");
  CHECK(printable(std::string("nul\0end", 7)) == "nul\\x00end");
  CHECK(printable("del\x7f") == "del\\x7f");
  // UTF-8 as it is (the messages' own "≥", "×", "→", a user's "é" or "漢"), C1 controls escaped.
  CHECK(printable("≥ × → é 漢 🙂") == "≥ × → é 漢 🙂");
  CHECK(printable("csi\xc2\x9b" "2J") == "csi\\u009b2J");
  CHECK(printable("nbsp\xc2\xa0") == "nbsp\xc2\xa0");
  // Bytes that are not UTF-8: a lone continuation, a truncated sequence, an overlong, a surrogate.
  CHECK(printable("\x9b" "2J") == "\\x9b2J");
  CHECK(printable("\xe6\xbc") == "\\xe6\\xbc");
  CHECK(printable("\xc0\xaf") == "\\xc0\\xaf");
  CHECK(printable("\xed\xa0\x80") == "\\xed\\xa0\\x80");
  CHECK(printable("\xf5\x80\x80\x80") == "\\xf5\\x80\\x80\\x80");
  const std::string once = printable("\x1b[31mred\n\xff");
  CHECK(printable(once) == once);
}

TEST_CASE("printable: every UserError and internal error message is escaped", "[cpu][core]") {
  try {
    throw_user_error("config file ", "a\x1b[2J.yaml", ": not found");
  } catch (const UserError& e) {
    CHECK(std::string(e.what()) == "config file a\\x1b[2J.yaml: not found");
  }
  try {
    MOP_CHECK(false, "path a\nb");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("path a\\nb") != std::string::npos);
  }
}
