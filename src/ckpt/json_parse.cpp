// JSON reader: one pass of recursive descent over the raw text, checking the grammar strictly and
// building the values as it goes (a value costs its Json, not a parser's tree beside it: a 20 MB
// tokenizer.json once took 5 GB through yaml-cpp's nodes).
#include <algorithm>
#include <charconv>
#include <cstdio>
#include <cstring>
#include <vector>

#include "ckpt/json.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

// Deeper nesting is surely corrupt input; the bound also keeps the recursion shallow.
constexpr int kMaxDepth = 256;

Json bare_scalar(std::string_view s, std::string_view source);

class JsonReader {
 public:
  JsonReader(std::string_view in, std::string_view source) : in_(in), source_(source) {}

  Json run() {
    skip_ws();
    if (pos_ == in_.size()) fail("empty input");
    Json v = value(0);
    skip_ws();
    if (pos_ != in_.size()) fail(std::string("unexpected '") + in_[pos_] + "' after the value");
    return v;
  }

 private:
  [[noreturn]] void fail(const std::string& problem) const {
    size_t line = 1, col = 1;
    for (size_t i = 0; i < pos_ && i < in_.size(); ++i) {
      if (in_[i] == '\n') {
        ++line;
        col = 1;
      } else {
        ++col;
      }
    }
    throw_user_error(source_, ": invalid JSON: ", problem, " (line ", line, ", column ", col, ")");
  }

  char peek() const { return pos_ < in_.size() ? in_[pos_] : '\0'; }

  void skip_ws() {
    while (pos_ < in_.size() &&
           (in_[pos_] == ' ' || in_[pos_] == '\t' || in_[pos_] == '\n' || in_[pos_] == '\r'))
      ++pos_;
  }

  void expect(char c, const char* what) {
    skip_ws();
    if (peek() != c) fail(std::string("expected ") + what);
    ++pos_;
  }

  Json value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    skip_ws();
    char c = peek();
    if (c == '{') {
      const size_t open = pos_++;
      Json::Object o;
      skip_ws();
      if (peek() == '}') {
        ++pos_;
        return Json(std::move(o));
      }
      for (;;) {
        skip_ws();
        if (peek() != '"') fail("expected a string key");
        std::string key = string();
        expect(':', "':' after a key");
        Json v = value(depth + 1);
        o.emplace_back(std::move(key), std::move(v));
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        if (peek() == '}') {
          ++pos_;
          break;
        }
        fail("expected ',' or '}'");
      }
      std::vector<std::string_view> keys;
      keys.reserve(o.size());
      for (const auto& [k, v] : o) keys.push_back(k);
      std::sort(keys.begin(), keys.end());
      if (auto dup = std::adjacent_find(keys.begin(), keys.end()); dup != keys.end()) {
        pos_ = open;
        fail("duplicate key \"" + std::string(*dup) + "\"");
      }
      return Json(std::move(o));
    }
    if (c == '[') {
      ++pos_;
      Json::Array a;
      skip_ws();
      if (peek() == ']') {
        ++pos_;
        return Json(std::move(a));
      }
      for (;;) {
        a.push_back(value(depth + 1));
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        if (peek() == ']') {
          ++pos_;
          return Json(std::move(a));
        }
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') return Json(string());
    return bare_token();
  }

  // true, false, null or a number in JSON's grammar: -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?
  Json bare_token() {
    size_t begin = pos_;
    while (pos_ < in_.size() && (std::isalnum(static_cast<unsigned char>(in_[pos_])) ||
                                 in_[pos_] == '-' || in_[pos_] == '+' || in_[pos_] == '.'))
      ++pos_;
    std::string_view t = in_.substr(begin, pos_ - begin);
    if (t.empty()) {
      if (pos_ == in_.size()) fail("unexpected end of input");
      fail(std::string("unexpected '") + in_[pos_] + "'");
    }
    if (t == "true") return Json(true);
    if (t == "false") return Json(false);
    if (t == "null") return Json();
    size_t i = 0;
    auto digits = [&] {
      size_t n = 0;
      while (i < t.size() && t[i] >= '0' && t[i] <= '9') ++i, ++n;
      return n;
    };
    bool ok = true;
    if (i < t.size() && t[i] == '-') ++i;
    if (i < t.size() && t[i] == '0')
      ++i;
    else
      ok = digits() > 0;
    if (ok && i < t.size() && t[i] == '.') {
      ++i;
      ok = digits() > 0;
    }
    if (ok && i < t.size() && (t[i] == 'e' || t[i] == 'E')) {
      ++i;
      if (i < t.size() && (t[i] == '+' || t[i] == '-')) ++i;
      ok = digits() > 0;
    }
    if (!ok || i != t.size()) {
      pos_ = begin;
      fail("'" + std::string(t) + "' is not a JSON value");
    }
    return bare_scalar(t, source_);
  }

  static int hex_digit(char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  }

  // The code unit of "\uXXXX" at `at`, or -1.
  int utf16_escape(size_t at) const {
    if (at + 6 > in_.size() || in_[at] != '\\' || in_[at + 1] != 'u') return -1;
    int v = 0;
    for (size_t k = 0; k < 4; ++k) {
      int d = hex_digit(in_[at + 2 + k]);
      if (d < 0) return -1;
      v = v * 16 + d;
    }
    return v;
  }

  // Length of the UTF-8 sequence starting at `at`, or 0 if it is not well-formed.
  size_t utf8_length(size_t at) const {
    auto b = [&](size_t k) {
      return at + k < in_.size() ? static_cast<unsigned char>(in_[at + k]) : 0u;
    };
    auto cont = [&](size_t k) { return (b(k) & 0xc0) == 0x80; };
    unsigned c = b(0);
    if (c >= 0xc2 && c <= 0xdf) return cont(1) ? 2 : 0;
    if (c >= 0xe0 && c <= 0xef) {
      unsigned lo = c == 0xe0 ? 0xa0 : 0x80,
               hi = c == 0xed ? 0x9f : 0xbf;  // no overlongs, no surrogates
      return b(1) >= lo && b(1) <= hi && cont(2) ? 3 : 0;
    }
    if (c >= 0xf0 && c <= 0xf4) {
      unsigned lo = c == 0xf0 ? 0x90 : 0x80, hi = c == 0xf4 ? 0x8f : 0xbf;
      return b(1) >= lo && b(1) <= hi && cont(2) && cont(3) ? 4 : 0;
    }
    return 0;
  }

  // A string at pos_ (its opening quote), decoded: escapes resolved, UTF-16 surrogate pairs joined.
  std::string string() {
    const size_t open = pos_++;
    std::string out;
    size_t run = pos_;  // start of the raw run not yet appended
    for (;;) {
      if (pos_ >= in_.size()) {
        pos_ = open;
        fail("unterminated string");
      }
      auto c = static_cast<unsigned char>(in_[pos_]);
      if (c == '"') break;
      if (c < 0x20) fail("control character in a string (must be escaped)");
      if (c >= 0x80) {
        size_t n = utf8_length(pos_);
        if (n == 0) fail("invalid UTF-8 in a string");
        pos_ += n;
        continue;
      }
      if (c != '\\') {
        ++pos_;
        continue;
      }
      out.append(in_.substr(run, pos_ - run));
      const char e = pos_ + 1 < in_.size() ? in_[pos_ + 1] : '\0';
      const char* simple = "\"\\/bfnrt";
      const char* decoded = "\"\\/\b\f\n\r\t";
      if (const char* at = e ? std::strchr(simple, e) : nullptr) {
        out += decoded[at - simple];
        pos_ += 2;
      } else {
        if (e != 'u') fail(std::string("invalid escape '\\") + e + "'");
        int hi = utf16_escape(pos_);
        if (hi < 0) fail("invalid \\u escape");
        if (hi >= 0xdc00 && hi <= 0xdfff) fail("lone UTF-16 low surrogate");
        unsigned cp = unsigned(hi);
        if (hi >= 0xd800 && hi <= 0xdbff) {
          int lo = utf16_escape(pos_ + 6);
          if (lo < 0xdc00 || lo > 0xdfff) fail("lone UTF-16 high surrogate");
          cp = 0x10000u + ((unsigned(hi) - 0xd800u) << 10) + (unsigned(lo) - 0xdc00u);
          pos_ += 6;
        }
        pos_ += 6;
        append_utf8(out, cp);
      }
      run = pos_;
    }
    out.append(in_.substr(run, pos_ - run));
    ++pos_;
    return out;
  }

  static void append_utf8(std::string& out, unsigned cp) {
    if (cp < 0x80) {
      out += char(cp);
    } else if (cp < 0x800) {
      out += char(0xc0 | (cp >> 6)), out += char(0x80 | (cp & 0x3f));
    } else if (cp < 0x10000) {
      out += char(0xe0 | (cp >> 12)), out += char(0x80 | ((cp >> 6) & 0x3f)), out += char(0x80 | (cp & 0x3f));
    } else {
      out += char(0xf0 | (cp >> 18)), out += char(0x80 | ((cp >> 12) & 0x3f));
      out += char(0x80 | ((cp >> 6) & 0x3f)), out += char(0x80 | (cp & 0x3f));
    }
  }

  std::string_view in_;
  std::string_view source_;
  size_t pos_ = 0;
};

// A number the grammar passed: an exact integer where it is one (int64, else uint64), a double.
Json bare_scalar(std::string_view s, std::string_view source) {
  const char* b = s.data();
  const char* e = b + s.size();
  if (s.find_first_of(".eE") == std::string::npos) {
    int64_t i;
    auto r = std::from_chars(b, e, i);
    if (r.ec == std::errc() && r.ptr == e) return Json(i);
    uint64_t u;
    r = std::from_chars(b, e, u);
    if (r.ec == std::errc() && r.ptr == e) return Json(u);
  }
  double d;
  auto r = std::from_chars(b, e, d);
  if (r.ec != std::errc() || r.ptr != e)
    throw_user_error(source, ": invalid JSON: number ", std::string(s), " out of range");
  return Json(d);
}

}  // namespace

Json parse_json(std::string_view text, std::string_view source) { return JsonReader(text, source).run(); }

Json read_json_file(const std::filesystem::path& path) {
  return parse_json(read_small_file(path, "", kConfigFileCap), path.string());
}

}  // namespace mop
