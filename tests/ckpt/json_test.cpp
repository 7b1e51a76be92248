// JSON writer and the yaml-cpp-backed reader: exact output text, round trips of every kind,
// strings with escapes and non-BMP characters, and rejection of everything that is not JSON.
#include <yaml-cpp/yaml.h>

#include <cmath>
#include <cstring>
#include <limits>

#include "catch.h"
#include "ckpt/json.h"
#include "ckpt_test_util.h"
#include "test_util.h"

using namespace mop;

namespace {
Json parse(std::string_view text) {
  return parse_json(text, "test.json");
}
}  // namespace

TEST_CASE("json: writer escapes strings like serde_json", "[cpu][ckpt]") {
  const char raw[] = "q\" b\\ n\n t\t r\r b\b f\f \x01\x1f\x7f / \xc3\xa9 \0!";
  const std::string in(raw, sizeof raw - 1);
  std::string out;
  json_append_string(out, in);
  CHECK(out == "\"q\\\" b\\\\ n\\n t\\t r\\r b\\b f\\f \\u0001\\u001f\x7f / \xc3\xa9 \\u0000!\"");
  // And the reader gives back the same bytes, NUL included.
  CHECK(parse(out).as_string() == in);
}

TEST_CASE("json: integers are exact over the whole int64 and uint64 range", "[cpu][ckpt]") {
  const int64_t i_min = std::numeric_limits<int64_t>::min(),
                i_max = std::numeric_limits<int64_t>::max();
  const uint64_t u_max = std::numeric_limits<uint64_t>::max();
  const int64_t beyond_double = (int64_t(1) << 53) + 1;  // not representable as a double
  Json j = Json::object();
  j["min"] = i_min;
  j["max"] = i_max;
  j["umax"] = u_max;
  j["big"] = beyond_double;
  j["small_unsigned"] = uint64_t(7);
  CHECK(j.dump() ==
        "{\"min\":-9223372036854775808,\"max\":9223372036854775807,\"umax\":18446744073709551615,"
        "\"big\":9007199254740993,\"small_unsigned\":7}");
  Json r = parse(j.dump());
  CHECK(r == j);
  CHECK(r.at("min").as_int64() == i_min);
  CHECK(r.at("umax").as_uint64() == u_max);
  CHECK(r.at("big").as_int64() == beyond_double);
  CHECK(r.at("small_unsigned").kind() == Json::Kind::Int);
  CHECK_USER_ERROR(r.at("umax").as_int64("x"), "x: integer 18446744073709551615 out of range");
  CHECK_USER_ERROR(r.at("min").as_uint64("x"), "x: expected a non-negative integer");
}

TEST_CASE("json: doubles round-trip bit for bit and stay doubles", "[cpu][ckpt]") {
  const double values[] = {0.1,  2.0,     -0.0,          1e300,    5e-324,
                           3e-4, 1.0 / 3, 123456789.125, -2.5e-10, 1e21};
  for (double v : values) {
    Json j(v);
    std::string text = j.dump();
    INFO(text);
    Json r = parse(text);
    REQUIRE(r.kind() == Json::Kind::Double);
    double back = r.as_double();
    CHECK(std::memcmp(&back, &v, sizeof v) == 0);
  }
  CHECK(Json(0.1).dump() == "0.1");
  CHECK(Json(2.0).dump() == "2.0");  // stays a double on reading back
  CHECK(Json(1e21).dump() == "1e+21");
  CHECK_THROWS_AS(Json(std::nan("")), Error);
  CHECK_THROWS_AS(Json(std::numeric_limits<double>::infinity()), Error);
  CHECK_THROWS_AS(Json(-std::numeric_limits<float>::infinity()), Error);
}

TEST_CASE("json: nested values round-trip compact and indented", "[cpu][ckpt]") {
  Json j = Json::object();
  j["null"] = nullptr;
  j["t"] = true;
  j["f"] = false;
  j["s"] = "line\nnext \"q\"";
  j["empty_obj"] = Json::object();
  j["empty_arr"] = Json::array();
  j["arr"].push_back(1);
  j["arr"].push_back(-2.5);
  j["arr"].push_back("x");
  j["arr"].push_back(Json::array());
  j["obj"]["inner"]["deeper"] = "v";
  j["obj"]["n"] = 3;
  CHECK(j.dump() ==
        "{\"null\":null,\"t\":true,\"f\":false,\"s\":\"line\\nnext "
        "\\\"q\\\"\",\"empty_obj\":{},\"empty_arr\":[],"
        "\"arr\":[1,-2.5,\"x\",[]],\"obj\":{\"inner\":{\"deeper\":\"v\"},\"n\":3}}");
  CHECK(
      j.dump(2) ==
      "{\n  \"null\": null,\n  \"t\": true,\n  \"f\": false,\n  \"s\": \"line\\nnext \\\"q\\\"\",\n"
      "  \"empty_obj\": {},\n  \"empty_arr\": [],\n  \"arr\": [\n    1,\n    -2.5,\n    \"x\",\n   "
      " []\n  ],\n"
      "  \"obj\": {\n    \"inner\": {\n      \"deeper\": \"v\"\n    },\n    \"n\": 3\n  }\n}\n");
  CHECK(parse(j.dump()) == j);
  CHECK(parse(j.dump(2)) == j);
  CHECK(parse(j.dump(0)) == j);
  // Windows line endings and tabs are JSON whitespace too.
  CHECK(parse("{\r\n\t\"a\" :\t[ 1 ,2 ]\r\n}") == parse("{\"a\":[1,2]}"));
  // Strings that look like numbers or keywords stay strings; the keywords are not strings.
  Json k = parse(R"({"a":"1","b":"true","c":"null","d":true,"e":null,"f":""})");
  CHECK(k.at("a").as_string() == "1");
  CHECK(k.at("b").as_string() == "true");
  CHECK(k.at("c").as_string() == "null");
  CHECK(k.at("d").as_bool());
  CHECK(k.at("e").is_null());
  CHECK(k.at("f").as_string().empty());
}

TEST_CASE("json: strings with YAML-significant text survive write → read", "[cpu][ckpt]") {
  // Inside JSON quotes none of this may be interpreted: indicators, keywords, spaces at the ends.
  const char* strings[] = {"",    " ",   "  lead", "trail  ", "# c",  "a: b", "- x",
                           "&a",  "*a",  "!tag",   "%YAML",   "@",    "`",    "'q'",
                           "{",   "}",   "[",      "]",       ",",    "?",    "|",
                           ">",   "\\",  "null",   "~",       "true", "1",    "0x1F",
                           "---", "...", "\t a",   "a\n\nb",  "\r\n", "é"};
  Json arr = Json::array();
  Json obj = Json::object();
  for (const char* s : strings) {
    arr.push_back(s);
    obj[s] = s;
  }
  for (int indent : {-1, 2}) {
    INFO("indent " << indent);
    CHECK(parse(arr.dump(indent)) == arr);
    CHECK(parse(obj.dump(indent)) == obj);
  }
  CHECK(parse("42").as_int64() == 42);
  CHECK(parse(" \"top\" ").as_string() == "top");
}

TEST_CASE("json: reader decodes escapes, surrogate pairs and long keys", "[cpu][ckpt]") {
  // What Python's json.dumps (ensure_ascii) writes for "é 😀 /".
  CHECK(parse(R"(["caf\u00e9 \ud83d\ude00 \/ \u00E9"])").as_array()[0].as_string() ==
        "caf\xc3\xa9 \xf0\x9f\x98\x80 / \xc3\xa9");
  CHECK(parse(R"({"\ud83d\ude00":1})").as_object()[0].first == "\xf0\x9f\x98\x80");
  CHECK(parse("\"raw \xf0\x9f\x98\x80 utf8\"").as_string() == "raw \xf0\x9f\x98\x80 utf8");
  // yaml-cpp refuses implicit keys over 1024 characters; the reader makes them explicit.
  std::string key(5000, 'k');
  std::string emoji_key = std::string(2000, 'e') + "\\ud83d\\ude00";
  Json j = parse("{\"a\":1,\"" + key + "\":{\"x\":[1,2]},\"" + emoji_key + "\":2,\"b\":\"" + key +
                 "\"}");
  CHECK(j.at(key).at("x").as_array()[1].as_int64() == 2);
  CHECK(j.at(std::string(2000, 'e') + "\xf0\x9f\x98\x80").as_int64() == 2);
  CHECK(j.at("b").as_string() == key);
  // A Hugging Face index file, as transformers writes it (json.dumps(indent=2, sort_keys=True)).
  Json idx = parse(R"({
  "metadata": {
    "total_size": 11811160064
  },
  "weight_map": {
    "lm_head.weight": "model-00002-of-00002.safetensors",
    "model.embed_tokens.weight": "model-00001-of-00002.safetensors"
  }
})");
  CHECK(idx.at("metadata").at("total_size").as_int64() == 11811160064);
  CHECK(idx.at("weight_map").at("lm_head.weight").as_string() ==
        "model-00002-of-00002.safetensors");
}

TEST_CASE("json: strings stay strings, numbers numbers; escapes and surrogate pairs decoded", "[cpu][ckpt]") {
  const Json j = parse_json(R"({"s":"1","n":1,"z":null,"e":"a\"\\\/\b\f\n\r\t\u00e9\ud83d\ude00","k":"\u0000x"})", "t.json");
  CHECK(j.at("s").is_string());
  CHECK(j.at("n").is_integer());
  CHECK(j.at("z").is_null());
  CHECK(j.at("e").as_string() == "a\"\\/\b\f\n\r\t\xc3\xa9\xf0\x9f\x98\x80");
  CHECK(j.at("k").as_string() == std::string("\0x", 2));
  CHECK_USER_ERROR(parse_json("{'a':1}", "t.json"), "t.json: invalid JSON");
}

TEST_CASE("json: everything outside strict JSON is a UserError naming the source", "[cpu][ckpt]") {
  const std::pair<const char*, const char*> bad[] = {
      {"", "empty input"},
      {"  \n ", "empty input"},
      {R"({"a":1,})", "expected a string key"},
      {R"([1,2,])", "unexpected ']'"},
      {R"({"a":1} xyz)", "after the value"},
      {R"({"a":1}{"b":2})", "after the value"},
      {"{\"a\":1 # comment\n}", "expected ',' or '}'"},
      {"{'a':1}", "expected a string key"},
      {"{a: 1}", "expected a string key"},
      {R"({"a" 1})", "expected ':'"},
      {R"({"a":1)", "expected ',' or '}'"},
      {R"([1 2])", "expected ',' or ']'"},
      {R"({"a":01})", "'01' is not a JSON value"},
      {R"({"a":.5})", "'.5' is not a JSON value"},
      {R"({"a":1.})", "'1.' is not a JSON value"},
      {R"({"a":True})", "'True' is not a JSON value"},
      {R"({"a":NaN})", "'NaN' is not a JSON value"},
      {R"({"a":~})", "unexpected '~'"},
      {R"({"a":&x 1})", "unexpected '&'"},
      {R"({"a":"x)", "unterminated string"},
      {"{\"a\":\"x\ny\"}", "control character"},
      {R"({"a":"\q"})", "invalid escape"},
      {R"({"a":"\x41"})", "invalid escape"},
      {R"({"a":"\u12"})", "invalid \\u escape"},
      {R"({"a":"\ud83d"})", "lone UTF-16 high surrogate"},
      {R"({"a":"\ude00"})", "lone UTF-16 low surrogate"},
      {"{\"a\":\"\xff\"}", "invalid UTF-8"},
      {"{\"a\":\"\xc0\xaf\"}", "invalid UTF-8"},      // overlong '/'
      {"{\"a\":\"\xed\xa0\x80\"}", "invalid UTF-8"},  // encoded surrogate
      {"\xef\xbb\xbf{}", "unexpected"},               // BOM
      {R"({"a":1,"a":2})", "duplicate key \"a\""},
      {R"({"a":1e999})", "out of range"},
  };
  for (auto [text, part] : bad) {
    INFO("input: " << text);
    CHECK_USER_ERROR(parse(text), part);
    CHECK_USER_ERROR(parse(text), "test.json: invalid JSON");
  }
  CHECK_USER_ERROR(parse("{\n  \"a\": tru\n}"), "(line 2, column 8)");
  CHECK_USER_ERROR(parse(std::string(300, '[') + std::string(300, ']')),
                        "nesting deeper than 256");
  CHECK(parse(std::string(200, '[') + std::string(200, ']')).is_array());
}

TEST_CASE("json: typed reads name the value on a wrong kind", "[cpu][ckpt]") {
  Json j = parse(R"({"step":"40","cfg":{"lr":3},"list":[1]})");
  CHECK_USER_ERROR(j.at("step").as_int64("m.json: step"),
                        "m.json: step: expected an integer, got a string");
  CHECK_USER_ERROR(j.at("missing", "m.json"), "m.json: missing field 'missing'");
  CHECK_USER_ERROR(j.at("list").as_object("m.json: list"), "expected an object, got an array");
  CHECK(j.at("cfg").at("lr").as_double() == 3.0);
  CHECK(j.find("nope") == nullptr);
  CHECK(j.at("list").find("x") == nullptr);
  CHECK(j.size() == 3);
  CHECK_THROWS_AS(j["list"]["x"], Error);  // operator[] on an array is a program bug
}

TEST_CASE("json: read_json_file names the file", "[cpu][ckpt]") {
  ckpt_test::TempDir tmp;
  ckpt_test::write_bytes(tmp / "ok.json", R"({"a":[1,2,3]})");
  CHECK(read_json_file(tmp / "ok.json").at("a").size() == 3);
  ckpt_test::write_bytes(tmp / "bad.json", R"({"a":[1,2,3})");
  CHECK_USER_ERROR(read_json_file(tmp / "bad.json"),
                        tmp / "bad.json" + ": invalid JSON");
  CHECK_USER_ERROR(read_json_file(tmp / "none.json"), "none.json: not found");
}
