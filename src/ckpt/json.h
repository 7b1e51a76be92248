// JSON for checkpoint manifests and safetensors headers: a small value type (Json) with exact
// 64-bit integers and round-trip doubles, a writer (compact or indented), and a reader that
// checks the text against the JSON grammar strictly as it builds the values.
// Errors in parsed input and ill-typed reads are UserErrors that name their source.
#pragma once

#include <concepts>
#include <cstdint>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace mop {

class Json {
 public:
  // Integers in the int64 range are Int; only values above INT64_MAX are UInt, so a value keeps
  // its kind through write → read.
  enum class Kind : uint8_t { Null, Bool, Int, UInt, Double, String, Array, Object };
  using Array = std::vector<Json>;
  // Objects keep insertion order (files read the way they were written); lookups are linear,
  // which suits the small records they hold.
  using Object = std::vector<std::pair<std::string, Json>>;

  Json() = default;
  Json(std::nullptr_t) {}
  Json(bool b) : v_(b) {}
  template <std::integral T>
  requires(!std::same_as<T, bool> && !std::same_as<T, char>) Json(T x) {
    if constexpr (std::is_signed_v<T>)
      v_ = int64_t(x);
    else if (uint64_t(x) <= uint64_t(INT64_MAX))
      v_ = int64_t(x);
    else
      v_ = uint64_t(x);
  }
  // NaN and ±Inf have no JSON spelling: they are rejected here (MOP_CHECK), so a value that exists
  // can always be written.
  Json(double x);
  Json(float x) : Json(double(x)) {}
  Json(std::string s) : v_(std::move(s)) {}
  Json(std::string_view s) : v_(std::string(s)) {}
  Json(const char* s) : v_(std::string(s)) {}
  Json(Array a) : v_(std::move(a)) {}
  Json(Object o) : v_(std::move(o)) {}

  static Json array() { return Json(Array{}); }
  static Json object() { return Json(Object{}); }

  Kind kind() const { return Kind(v_.index()); }
  bool is_null() const { return kind() == Kind::Null; }
  bool is_object() const { return kind() == Kind::Object; }
  bool is_array() const { return kind() == Kind::Array; }
  bool is_string() const { return kind() == Kind::String; }
  bool is_integer() const { return kind() == Kind::Int || kind() == Kind::UInt; }
  bool is_number() const { return is_integer() || kind() == Kind::Double; }

  // Typed reads. `where` names the value for the error ("ckpt/step_40/manifest.json: step"); a
  // wrong kind or an integer out of range throws UserError("<where>: expected ..., got ...").
  bool as_bool(std::string_view where = "json") const;
  int64_t as_int64(std::string_view where = "json") const;
  uint64_t as_uint64(std::string_view where = "json") const;
  double as_double(std::string_view where = "json") const;  // any number
  const std::string& as_string(std::string_view where = "json") const;
  const Array& as_array(std::string_view where = "json") const;
  const Object& as_object(std::string_view where = "json") const;
  Array& as_array(std::string_view where = "json");
  Object& as_object(std::string_view where = "json");

  // Object member or nullptr (also nullptr when this is not an object).
  const Json* find(std::string_view key) const;
  // Object member; a missing key (or a non-object) throws UserError("<where>: missing field
  // 'key'").
  const Json& at(std::string_view key, std::string_view where = "json") const;
  // Object member, appended as null when missing; a null value becomes an empty object first.
  Json& operator[](std::string_view key);
  // Appends to an array; a null value becomes an empty array first.
  void push_back(Json v);
  // Elements of an array or members of an object; 0 otherwise.
  size_t size() const;

  // Compact (indent < 0, like serde_json and the safetensors reference writer) or one member per
  // line indented by `indent` spaces.
  std::string dump(int indent = -1) const;

  friend bool operator==(const Json& a, const Json& b);

 private:
  std::variant<std::monostate, bool, int64_t, uint64_t, double, std::string, Array, Object> v_;
};

std::string_view json_kind_name(Json::Kind kind);

// Appends `s` as a JSON string literal: quotes, backslash and control characters escaped (\n, \t,
// ... or \u00XX), everything else — UTF-8 included — copied as is.
void json_append_string(std::string& out, std::string_view s);
// Shortest text that reads back to the same double, with ".0" added when it would read as an
// integer. MOP_CHECKs that x is finite.
void json_append_double(std::string& out, double x);

// Parses JSON text. Anything outside strict JSON (trailing commas, comments, single quotes,
// unquoted keys, trailing garbage, duplicate keys, lone UTF-16 surrogates) is a UserError
// "<source>: invalid JSON: <problem> (line L, column C)".
Json parse_json(std::string_view text, std::string_view source);
// Reads and parses a file; the file's path is the source in errors.
Json read_json_file(const std::filesystem::path& path);

}  // namespace mop
