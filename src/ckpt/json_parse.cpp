// JSON reader: a grammar check over the raw text, then yaml-cpp for decoding.
// yaml-cpp alone would accept much that is not JSON (trailing commas, comments, single quotes,
// unquoted keys, anything after the first value) and rejects two things that are: UTF-16
// surrogate-pair escapes ("\ud83d\ude00", as Python's json.dumps writes non-BMP characters) and
// implicit keys over 1024 characters. The check rewrites those two into YAML's "\U0001f600" and
// an explicit "? " key; everything else reaches yaml-cpp unchanged.
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <charconv>
#include <cstdio>

#include "ckpt/json.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

// Deeper nesting is surely corrupt input; the bound also keeps yaml-cpp's recursion shallow.
constexpr int kMaxDepth = 256;
// yaml-cpp's limit on an implicit key is 1024 characters; keys this long or longer get "? ".
constexpr size_t kExplicitKeyLength = 256;

class JsonScanner {
 public:
  JsonScanner(std::string_view in, std::string_view source) : in_(in), source_(source) {}

  // Checks the grammar; returns the text to hand to yaml-cpp.
  std::string run() {
    skip_ws();
    if (pos_ == in_.size()) fail("empty input");
    value(0);
    skip_ws();
    if (pos_ != in_.size()) fail(std::string("unexpected '") + in_[pos_] + "' after the value");
    out_.append(in_.substr(copied_));
    return std::move(out_);
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

  void value(int depth) {
    if (depth > kMaxDepth) fail("nesting deeper than " + std::to_string(kMaxDepth));
    skip_ws();
    char c = peek();
    if (c == '{') {
      ++pos_;
      skip_ws();
      if (peek() == '}') {
        ++pos_;
        return;
      }
      for (;;) {
        skip_ws();
        if (peek() != '"') fail("expected a string key");
        string(true);
        expect(':', "':' after a key");
        value(depth + 1);
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        if (peek() == '}') {
          ++pos_;
          return;
        }
        fail("expected ',' or '}'");
      }
    }
    if (c == '[') {
      ++pos_;
      skip_ws();
      if (peek() == ']') {
        ++pos_;
        return;
      }
      for (;;) {
        value(depth + 1);
        skip_ws();
        if (peek() == ',') {
          ++pos_;
          continue;
        }
        if (peek() == ']') {
          ++pos_;
          return;
        }
        fail("expected ',' or ']'");
      }
    }
    if (c == '"') return string(false);
    bare_token();
  }

  // true, false, null or a number in JSON's grammar: -?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?
  void bare_token() {
    size_t begin = pos_;
    while (pos_ < in_.size() && (std::isalnum(static_cast<unsigned char>(in_[pos_])) ||
                                 in_[pos_] == '-' || in_[pos_] == '+' || in_[pos_] == '.'))
      ++pos_;
    std::string_view t = in_.substr(begin, pos_ - begin);
    if (t.empty()) {
      if (pos_ == in_.size()) fail("unexpected end of input");
      fail(std::string("unexpected '") + in_[pos_] + "'");
    }
    if (t == "true" || t == "false" || t == "null") return;
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

  void string(bool is_key) {
    size_t open = pos_++;
    size_t key_at = 0;  // where the key's quote lands in out_
    if (is_key) {
      out_.append(in_.substr(copied_, open - copied_));
      copied_ = open;
      key_at = out_.size();
    }
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
      char e = pos_ + 1 < in_.size() ? in_[pos_ + 1] : '\0';
      if (std::string_view("\"\\/bfnrt").find(e) != std::string_view::npos && e != '\0') {
        pos_ += 2;
        continue;
      }
      if (e != 'u') fail(std::string("invalid escape '\\") + e + "'");
      int hi = utf16_escape(pos_);
      if (hi < 0) fail("invalid \\u escape");
      if (hi >= 0xdc00 && hi <= 0xdfff) fail("lone UTF-16 low surrogate");
      if (hi < 0xd800 || hi > 0xdbff) {
        pos_ += 6;
        continue;
      }
      int lo = utf16_escape(pos_ + 6);
      if (lo < 0xdc00 || lo > 0xdfff) fail("lone UTF-16 high surrogate");
      unsigned cp = 0x10000u + ((unsigned(hi) - 0xd800u) << 10) + (unsigned(lo) - 0xdc00u);
      char buf[16];
      std::snprintf(buf, sizeof buf, "\\U%08X", cp);
      out_.append(in_.substr(copied_, pos_ - copied_));
      out_ += buf;
      pos_ += 12;
      copied_ = pos_;
    }
    ++pos_;
    if (is_key && pos_ - open >= kExplicitKeyLength) out_.insert(key_at, "? ");
  }

  std::string_view in_;
  std::string_view source_;
  size_t pos_ = 0;
  std::string out_;
  size_t copied_ = 0;  // in_[0, copied_) is already in out_
};

Json from_yaml(const YAML::Node& n, std::string_view source);

Json bare_scalar(const std::string& s, std::string_view source) {
  if (s == "true") return Json(true);
  if (s == "false") return Json(false);
  if (s == "null") return Json();
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
    throw_user_error(source, ": invalid JSON: number ", s, " out of range");
  return Json(d);
}

Json from_yaml(const YAML::Node& n, std::string_view source) {
  switch (n.Type()) {
    case YAML::NodeType::Null:
      return Json();
    case YAML::NodeType::Scalar:
      // Quoted scalars carry the non-specific tag "!", plain ones "?": a string vs. a number.
      return n.Tag() == "!" ? Json(n.Scalar()) : bare_scalar(n.Scalar(), source);
    case YAML::NodeType::Sequence: {
      Json::Array a;
      a.reserve(n.size());
      for (const auto& e : n) a.push_back(from_yaml(e, source));
      return Json(std::move(a));
    }
    case YAML::NodeType::Map: {
      Json::Object o;
      o.reserve(n.size());
      for (const auto& kv : n) o.emplace_back(kv.first.Scalar(), from_yaml(kv.second, source));
      std::vector<std::string_view> keys;
      keys.reserve(o.size());
      for (const auto& [k, v] : o) keys.push_back(k);
      std::sort(keys.begin(), keys.end());
      auto dup = std::adjacent_find(keys.begin(), keys.end());
      if (dup != keys.end())
        throw_user_error(source, ": invalid JSON: duplicate key \"", *dup, "\"");
      return Json(std::move(o));
    }
    case YAML::NodeType::Undefined:
      break;
  }
  throw_user_error(source, ": invalid JSON: undefined node");
}

}  // namespace

YAML::Node parse_json_yaml(std::string_view text, std::string_view source) {
  std::string yaml_text = JsonScanner(text, source).run();
  try {
    return YAML::Load(yaml_text);
  } catch (const YAML::Exception& e) {
    throw_user_error(source, ": invalid JSON: ", e.msg, " (line ", e.mark.line + 1, ", column ",
                     e.mark.column + 1, ")");
  }
}

Json parse_json(std::string_view text, std::string_view source) {
  return from_yaml(parse_json_yaml(text, source), source);
}

Json read_json_file(const std::filesystem::path& path) {
  return parse_json(read_small_file(path, "", kConfigFileCap), path.string());
}

}  // namespace mop
