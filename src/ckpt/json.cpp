// Json value: typed reads with UserErrors naming the value, and the writer (compact or indented,
// exact integers, shortest round-trip doubles). The reader is in json_parse.cpp.
#include "ckpt/json.h"

#include <charconv>
#include <cmath>

#include "core/error.h"

namespace mop {

Json::Json(double x) : v_(x) {
  MOP_CHECK(std::isfinite(x), "JSON cannot represent ", x, " (NaN and Inf have no JSON spelling)");
}

std::string_view json_kind_name(Json::Kind kind) {
  switch (kind) {
    case Json::Kind::Null:
      return "null";
    case Json::Kind::Bool:
      return "a boolean";
    case Json::Kind::Int:
    case Json::Kind::UInt:
      return "an integer";
    case Json::Kind::Double:
      return "a number";
    case Json::Kind::String:
      return "a string";
    case Json::Kind::Array:
      return "an array";
    case Json::Kind::Object:
      return "an object";
  }
  return "?";
}

namespace {
[[noreturn]] void wrong_kind(std::string_view where, std::string_view expected, Json::Kind got) {
  throw_user_error(where, ": expected ", expected, ", got ", json_kind_name(got));
}
}  // namespace

bool Json::as_bool(std::string_view where) const {
  if (auto* b = std::get_if<bool>(&v_)) return *b;
  wrong_kind(where, "a boolean", kind());
}

int64_t Json::as_int64(std::string_view where) const {
  if (auto* i = std::get_if<int64_t>(&v_)) return *i;
  if (kind() == Kind::UInt)
    throw_user_error(where, ": integer ", std::get<uint64_t>(v_), " out of range");
  wrong_kind(where, "an integer", kind());
}

uint64_t Json::as_uint64(std::string_view where) const {
  if (auto* u = std::get_if<uint64_t>(&v_)) return *u;
  if (auto* i = std::get_if<int64_t>(&v_)) {
    if (*i < 0) throw_user_error(where, ": expected a non-negative integer, got ", *i);
    return uint64_t(*i);
  }
  wrong_kind(where, "a non-negative integer", kind());
}

double Json::as_double(std::string_view where) const {
  if (auto* d = std::get_if<double>(&v_)) return *d;
  if (auto* i = std::get_if<int64_t>(&v_)) return double(*i);
  if (auto* u = std::get_if<uint64_t>(&v_)) return double(*u);
  wrong_kind(where, "a number", kind());
}

const std::string& Json::as_string(std::string_view where) const {
  if (auto* s = std::get_if<std::string>(&v_)) return *s;
  wrong_kind(where, "a string", kind());
}

const Json::Array& Json::as_array(std::string_view where) const {
  if (auto* a = std::get_if<Array>(&v_)) return *a;
  wrong_kind(where, "an array", kind());
}

const Json::Object& Json::as_object(std::string_view where) const {
  if (auto* o = std::get_if<Object>(&v_)) return *o;
  wrong_kind(where, "an object", kind());
}

Json::Array& Json::as_array(std::string_view where) {
  return const_cast<Array&>(std::as_const(*this).as_array(where));
}

Json::Object& Json::as_object(std::string_view where) {
  return const_cast<Object&>(std::as_const(*this).as_object(where));
}

const Json* Json::find(std::string_view key) const {
  if (auto* o = std::get_if<Object>(&v_))
    for (const auto& [k, v] : *o)
      if (k == key) return &v;
  return nullptr;
}

const Json& Json::at(std::string_view key, std::string_view where) const {
  const Object& o = as_object(where);
  for (const auto& [k, v] : o)
    if (k == key) return v;
  throw_user_error(where, ": missing field '", key, "'");
}

Json& Json::operator[](std::string_view key) {
  if (is_null()) v_ = Object{};
  MOP_CHECK(is_object(), "operator[](\"", key, "\") on ", json_kind_name(kind()));
  Object& o = std::get<Object>(v_);
  for (auto& [k, v] : o)
    if (k == key) return v;
  return o.emplace_back(std::string(key), Json()).second;
}

void Json::push_back(Json v) {
  if (is_null()) v_ = Array{};
  MOP_CHECK(is_array(), "push_back on ", json_kind_name(kind()));
  std::get<Array>(v_).push_back(std::move(v));
}

size_t Json::size() const {
  if (auto* a = std::get_if<Array>(&v_)) return a->size();
  if (auto* o = std::get_if<Object>(&v_)) return o->size();
  return 0;
}

bool operator==(const Json& a, const Json& b) {
  return a.v_ == b.v_;
}

void json_append_string(std::string& out, std::string_view s) {
  static constexpr char kHex[] = "0123456789abcdef";
  out += '"';
  for (char c : s) {
    auto u = static_cast<unsigned char>(c);
    switch (c) {
      case '"':
        out += "\\\"";
        break;
      case '\\':
        out += "\\\\";
        break;
      case '\b':
        out += "\\b";
        break;
      case '\f':
        out += "\\f";
        break;
      case '\n':
        out += "\\n";
        break;
      case '\r':
        out += "\\r";
        break;
      case '\t':
        out += "\\t";
        break;
      default:
        if (u < 0x20) {
          out += "\\u00";
          out += kHex[u >> 4];
          out += kHex[u & 15];
        } else {
          out += c;
        }
    }
  }
  out += '"';
}

void json_append_double(std::string& out, double x) {
  MOP_CHECK(std::isfinite(x), "JSON cannot represent ", x);
  char buf[64];
  // Shortest representation that parses back to the same double (as %.17g, minus the noise).
  auto [end, ec] = std::to_chars(buf, buf + sizeof buf, x);
  MOP_CHECK(ec == std::errc(), "to_chars failed");
  std::string_view text(buf, size_t(end - buf));
  out += text;
  if (text.find_first_of(".eE") == std::string_view::npos) out += ".0";
}

namespace {

void newline(std::string& out, int indent, int depth) {
  if (indent < 0) return;
  out += '\n';
  out.append(size_t(indent) * size_t(depth), ' ');
}

void dump_to(std::string& out, const Json& v, int indent, int depth) {
  switch (v.kind()) {
    case Json::Kind::Null:
      out += "null";
      break;
    case Json::Kind::Bool:
      out += v.as_bool() ? "true" : "false";
      break;
    case Json::Kind::Int:
      out += std::to_string(v.as_int64());
      break;
    case Json::Kind::UInt:
      out += std::to_string(v.as_uint64());
      break;
    case Json::Kind::Double:
      json_append_double(out, v.as_double());
      break;
    case Json::Kind::String:
      json_append_string(out, v.as_string());
      break;
    case Json::Kind::Array: {
      const Json::Array& a = v.as_array();
      out += '[';
      for (size_t i = 0; i < a.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, depth + 1);
        dump_to(out, a[i], indent, depth + 1);
      }
      if (!a.empty()) newline(out, indent, depth);
      out += ']';
      break;
    }
    case Json::Kind::Object: {
      const Json::Object& o = v.as_object();
      out += '{';
      for (size_t i = 0; i < o.size(); ++i) {
        if (i) out += ',';
        newline(out, indent, depth + 1);
        json_append_string(out, o[i].first);
        out += indent < 0 ? ":" : ": ";
        dump_to(out, o[i].second, indent, depth + 1);
      }
      if (!o.empty()) newline(out, indent, depth);
      out += '}';
      break;
    }
  }
}

}  // namespace

std::string Json::dump(int indent) const {
  std::string out;
  dump_to(out, *this, indent, 0);
  if (indent >= 0) out += '\n';
  return out;
}

}  // namespace mop
