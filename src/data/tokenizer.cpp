// Byte-level BPE tokenizer from a Hugging Face tokenizer.json. encode() follows the `tokenizers`
// package step by step: added tokens are cut out of the raw text (leftmost, longest first; the
// normalized=false ones before normalization, the others after), the rest is normalized (NFC via
// ICU), split by the pre-tokenizer's regexes (PCRE2, UTF + UCP, JIT), mapped through GPT-2's
// bytes_to_unicode alphabet and merged by rank.
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <climits>
#include <fstream>
#include <iterator>
#include <mutex>
#include <unordered_map>
#include <utility>

#include "ckpt/json.h"
#include "core/error.h"

namespace mop {
namespace {

// GPT-2's split regex, what ByteLevel(use_regex=true) uses.
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// The BPE cache stops growing here (the `tokenizers` default capacity is 10'000 words).
constexpr size_t kMaxCachedWords = 100'000;

void append_utf8(std::string& out, uint32_t cp) {
  if (cp < 0x80) {
    out += char(cp);
  } else if (cp < 0x800) {
    out += char(0xC0 | (cp >> 6));
    out += char(0x80 | (cp & 0x3F));
  } else if (cp < 0x10000) {
    out += char(0xE0 | (cp >> 12));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  } else {
    out += char(0xF0 | (cp >> 18));
    out += char(0x80 | ((cp >> 12) & 0x3F));
    out += char(0x80 | ((cp >> 6) & 0x3F));
    out += char(0x80 | (cp & 0x3F));
  }
}

// Length of the valid UTF-8 sequence at s[i] (1..4), or the length of its longest valid prefix
// negated (-1..-3) when it is not one: Rust's from_utf8_lossy replaces such a maximal prefix
// with one U+FFFD.
int utf8_seq_len(std::string_view s, size_t i) {
  const auto b = uint8_t(s[i]);
  if (b < 0x80) return 1;
  int n;
  uint8_t lo = 0x80, hi = 0xBF;
  if (b >= 0xC2 && b <= 0xDF) {
    n = 2;
  } else if (b >= 0xE0 && b <= 0xEF) {
    n = 3;
    if (b == 0xE0) lo = 0xA0;
    if (b == 0xED) hi = 0x9F;
  } else if (b >= 0xF0 && b <= 0xF4) {
    n = 4;
    if (b == 0xF0) lo = 0x90;
    if (b == 0xF4) hi = 0x8F;
  } else {
    return -1;
  }
  for (int k = 1; k < n; ++k) {
    if (i + k >= s.size()) return -k;
    const auto c = uint8_t(s[i + k]);
    if (c < lo || c > hi) return -k;
    lo = 0x80, hi = 0xBF;
  }
  return n;
}

uint32_t decode_utf8_at(std::string_view s, size_t i, int len) {
  const auto b = uint8_t(s[i]);
  uint32_t cp = len == 1 ? b : len == 2 ? b & 0x1F : len == 3 ? b & 0x0F : b & 0x07;
  for (int k = 1; k < len; ++k) cp = (cp << 6) | (uint8_t(s[i + k]) & 0x3F);
  return cp;
}

// Rust's char::is_whitespace (the Unicode White_Space property), used by lstrip/rstrip.
bool is_white_space(uint32_t cp) {
  return (cp >= 0x09 && cp <= 0x0D) || cp == 0x20 || cp == 0x85 || cp == 0xA0 || cp == 0x1680 ||
         (cp >= 0x2000 && cp <= 0x200A) || cp == 0x2028 || cp == 0x2029 || cp == 0x202F ||
         cp == 0x205F || cp == 0x3000;
}

// GPT-2's bytes_to_unicode: printable Latin-1 bytes stand for themselves, the other 68 bytes
// are shifted to U+0100 onwards, so every byte is one visible character.
std::vector<uint32_t> bytes_to_unicode() {
  std::vector<uint32_t> map(256, 0);
  uint32_t next = 256;
  for (uint32_t b = 0; b < 256; ++b) {
    const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
    map[b] = printable ? b : next++;
  }
  return map;
}

struct Regex {
  pcre2_code* code = nullptr;
  Regex() = default;
  Regex(const Regex&) = delete;
  Regex(Regex&& o) noexcept : code(std::exchange(o.code, nullptr)) {}
  Regex& operator=(Regex&& o) noexcept {
    std::swap(code, o.code);
    return *this;
  }
  ~Regex() {
    if (code) pcre2_code_free(code);
  }
};

Regex compile_regex(std::string_view pattern, std::string_view where) {
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  Regex re;
  re.code = pcre2_compile(reinterpret_cast<PCRE2_SPTR>(pattern.data()), pattern.size(),
                          PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
  if (!re.code) {
    PCRE2_UCHAR msg[256];
    pcre2_get_error_message(err, msg, sizeof msg);
    throw_user_error(where, ": regex does not compile at offset ", err_offset, ": ",
                     reinterpret_cast<const char*>(msg));
  }
  pcre2_jit_compile(re.code, PCRE2_JIT_COMPLETE);  // the interpreter runs it when JIT is absent
  return re;
}

// Splits `text` into the matches of `re` and the gaps between them ("Isolated"), empty pieces
// dropped. Offsets are into `text`.
void split_isolated(const Regex& re, std::string_view text, std::vector<std::string_view>& out) {
  pcre2_match_data* md = pcre2_match_data_create_from_pattern(re.code, nullptr);
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, gap = 0;
  while (pos < text.size()) {
    const int rc = pcre2_match(re.code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    MOP_CHECK(rc > 0, "pcre2_match failed: ", rc);
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(md);
    const size_t start = ov[0], end = ov[1];
    if (start == end) {  // an empty match: step over one character
      if (end >= text.size()) break;
      pos = end + size_t(std::max(1, utf8_seq_len(text, end)));
      continue;
    }
    if (gap < start) out.push_back(text.substr(gap, start - gap));
    out.push_back(text.substr(start, end - start));
    gap = pos = end;
  }
  pcre2_match_data_free(md);
  if (gap < text.size()) out.push_back(text.substr(gap));
}

struct AddedToken {
  std::string content;
  int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false, normalized = false;
};

// Piece of the text between encode's steps: either an added token's id or text still to encode.
struct Segment {
  std::string_view text;
  int32_t added_id = -1;
};

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // vocab and added tokens; "" for ids with neither
  std::vector<bool> is_special;
  // (left id << 32 | right id) → (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  std::optional<int32_t> unk_id;
  bool ignore_merges = false;

  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;
  // Added tokens by first byte, longest first, for the raw (normalized=false) and normalized pass.
  std::vector<std::vector<const AddedToken*>> raw_by_byte, norm_by_byte;

  bool nfc = false;
  std::vector<Regex> splits;  // Split pre-tokenizers, in order, before the byte-level stage
  std::optional<Regex> byte_level_regex;
  bool add_prefix_space = false;

  std::vector<std::string> byte_char;               // byte → its alphabet character (UTF-8)
  std::unordered_map<uint32_t, uint8_t> char_byte;  // alphabet code point → byte

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  void index_added();
  void split_added(std::string_view text, bool normalized_pass, std::vector<Segment>& out) const;
  std::string normalize(std::string_view text) const;
  void pre_tokenize(std::string_view text, std::vector<int32_t>& ids) const;
  void bpe(const std::string& word, std::vector<int32_t>& ids) const;
};

void Tokenizer::Impl::index_added() {
  raw_by_byte.assign(256, {});
  norm_by_byte.assign(256, {});
  for (const AddedToken& t : added)
    (t.normalized ? norm_by_byte : raw_by_byte)[uint8_t(t.content[0])].push_back(&t);
  for (auto* table : {&raw_by_byte, &norm_by_byte})
    for (auto& bucket : *table)
      std::stable_sort(bucket.begin(), bucket.end(), [](const AddedToken* a, const AddedToken* b) {
        return a->content.size() > b->content.size();
      });
}

// AddedVocabulary::find_matches: leftmost-longest matches; lstrip/rstrip widen a match over the
// whitespace beside it (never back over an earlier match).
void Tokenizer::Impl::split_added(std::string_view text, bool normalized_pass,
                                  std::vector<Segment>& out) const {
  const auto& by_byte = normalized_pass ? norm_by_byte : raw_by_byte;
  size_t done = 0;  // end of the last match
  size_t pos = 0;
  while (pos < text.size()) {
    const AddedToken* hit = nullptr;
    for (const AddedToken* t : by_byte[uint8_t(text[pos])]) {
      if (text.compare(pos, t->content.size(), t->content) == 0) {
        hit = t;
        break;
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + hit->content.size();
    if (hit->lstrip) {
      // Walk back over whitespace characters (continuation bytes belong to the character).
      size_t s = start;
      while (s > done) {
        size_t c = s - 1;
        while (c > done && (uint8_t(text[c]) & 0xC0) == 0x80) --c;
        if (!is_white_space(decode_utf8_at(text, c, int(s - c)))) break;
        s = c;
      }
      start = s;
    }
    if (hit->rstrip) {
      while (stop < text.size()) {
        const int len = utf8_seq_len(text, stop);
        if (!is_white_space(decode_utf8_at(text, stop, len))) break;
        stop += size_t(len);
      }
    }
    if (done < start) out.push_back({text.substr(done, start - done), -1});
    out.push_back({text.substr(start, stop - start), hit->id});
    done = pos = stop;
  }
  if (done < text.size()) out.push_back({text.substr(done), -1});
}

std::string Tokenizer::Impl::normalize(std::string_view text) const {
  if (!nfc || std::all_of(text.begin(), text.end(), [](char c) { return uint8_t(c) < 0x80; }))
    return std::string(text);
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* norm = unorm2_getNFCInstance(&status);
  MOP_CHECK(U_SUCCESS(status), "ICU NFC: ", u_errorName(status));
  MOP_CHECK(text.size() < size_t(INT32_MAX / 2), "text too long for ICU: ", text.size());
  std::u16string in(text.size(), u'\0');
  int32_t in_len = 0;
  u_strFromUTF8(in.data(), int32_t(in.size()), &in_len, text.data(), int32_t(text.size()), &status);
  MOP_CHECK(U_SUCCESS(status), "ICU UTF-8 → UTF-16: ", u_errorName(status));
  // NFC of a UTF-16 string is at most 3× longer (Unicode's stated bound for NFC).
  std::u16string nfc_text(size_t(in_len) * 3 + 1, u'\0');
  const int32_t nfc_len =
      unorm2_normalize(norm, in.data(), in_len, nfc_text.data(), int32_t(nfc_text.size()), &status);
  MOP_CHECK(U_SUCCESS(status), "ICU NFC: ", u_errorName(status));
  std::string out(size_t(nfc_len) * 3, '\0');
  int32_t out_len = 0;
  u_strToUTF8(out.data(), int32_t(out.size()), &out_len, nfc_text.data(), nfc_len, &status);
  MOP_CHECK(U_SUCCESS(status), "ICU UTF-16 → UTF-8: ", u_errorName(status));
  out.resize(size_t(out_len));
  return out;
}

void Tokenizer::Impl::pre_tokenize(std::string_view text, std::vector<int32_t>& ids) const {
  std::vector<std::string_view> pieces{text}, next;
  for (const Regex& re : splits) {
    next.clear();
    for (std::string_view p : pieces) split_isolated(re, p, next);
    pieces.swap(next);
  }
  std::string prefixed, word;
  for (std::string_view p : pieces) {
    if (add_prefix_space && p[0] != ' ') {
      prefixed = " ";
      prefixed += p;
      p = prefixed;
    }
    next.clear();
    if (byte_level_regex)
      split_isolated(*byte_level_regex, p, next);
    else
      next.push_back(p);
    for (std::string_view w : next) {
      word.clear();
      for (char c : w) word += byte_char[uint8_t(c)];
      bpe(word, ids);
    }
  }
}

// Merges the word's characters pairwise, lowest rank first and leftmost among equal ranks (what
// the package's priority queue does), and appends the resulting ids.
void Tokenizer::Impl::bpe(const std::string& word, std::vector<int32_t>& ids) const {
  if (ignore_merges) {
    if (auto it = vocab.find(word); it != vocab.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  {
    std::lock_guard lock(cache_mutex);
    if (auto it = cache.find(word); it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> symbols;
  for (size_t i = 0; i < word.size();) {
    const int len = utf8_seq_len(word, i);
    MOP_CHECK(len > 0);
    if (auto it = vocab.find(word.substr(i, size_t(len))); it != vocab.end())
      symbols.push_back(it->second);
    else if (unk_id)
      symbols.push_back(*unk_id);
    i += size_t(len);
  }
  while (symbols.size() > 1) {
    int32_t best_rank = INT32_MAX, best_id = -1;
    size_t best_pos = 0;
    for (size_t i = 0; i + 1 < symbols.size(); ++i) {
      const uint64_t key = uint64_t(uint32_t(symbols[i])) << 32 | uint32_t(symbols[i + 1]);
      if (auto it = merges.find(key); it != merges.end() && it->second.first < best_rank) {
        best_rank = it->second.first;
        best_id = it->second.second;
        best_pos = i;
      }
    }
    if (best_id < 0) break;
    symbols[best_pos] = best_id;
    symbols.erase(symbols.begin() + std::ptrdiff_t(best_pos) + 1);
  }
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  std::lock_guard lock(cache_mutex);
  if (cache.size() < kMaxCachedWords) cache.emplace(word, std::move(symbols));
}

// ---- loading -------------------------------------------------------------------------------

namespace {

std::string type_of(const Json& j, std::string_view where) {
  return j.at("type", where).as_string(where);
}

bool flag(const Json& j, std::string_view key, bool fallback, const std::string& where) {
  const Json* v = j.find(key);
  return v && !v->is_null() ? v->as_bool(where + "." + std::string(key)) : fallback;
}

[[noreturn]] void unsupported(std::string_view source, std::string_view what,
                              std::string_view hint = "") {
  throw_user_error(source, ": ", what, " is not supported", hint.empty() ? "" : " (", hint,
                   hint.empty() ? "" : ")");
}

// Post-processors only add tokens (and offsets, type ids): encode() returns the text's ids, so
// one that would add a token is refused rather than silently left out.
void check_post_processor(const Json& p, const std::string& src) {
  const std::string where = src + ": post_processor";
  const std::string type = type_of(p, where);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    for (const Json& q : p.at("processors", where).as_array(where + ".processors"))
      check_post_processor(q, src);
    return;
  }
  if (type != "TemplateProcessing")
    unsupported(src, "post_processor " + type,
                "only null, ByteLevel and a TemplateProcessing that adds no tokens are");
  std::string added;
  for (const Json& piece : p.at("single", where).as_array(where + ".single")) {
    if (const Json* special = piece.find("SpecialToken"))
      added += (added.empty() ? "" : ", ") + special->at("id", where).as_string(where);
    else
      MOP_USER_CHECK(piece.find("Sequence") &&
                         piece.at("Sequence", where).at("id", where).as_string(where) == "A",
                     where, ": TemplateProcessing.single: expected SpecialToken or Sequence A");
  }
  if (!added.empty())
    unsupported(src, "post_processor TemplateProcessing that adds " + added,
                "encode() gives the text's ids only; add such tokens with token_id()");
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  MOP_USER_CHECK(std::filesystem::is_regular_file(path), path.string(),
                 ": no such file (expected a Hugging Face tokenizer.json)");
  std::ifstream f(path, std::ios::binary);
  std::string text((std::istreambuf_iterator<char>(f)), std::istreambuf_iterator<char>());
  MOP_USER_CHECK(!f.bad(), path.string(), ": cannot read the file");
  return from_json_text(text, path.string());
}

Tokenizer Tokenizer::from_json_text(std::string_view text, std::string_view source_view) {
  auto impl = std::make_unique<Impl>();
  Impl& t = *impl;
  t.source = std::string(source_view);
  const std::string& src = t.source;
  const Json root = parse_json(text, src);
  MOP_USER_CHECK(root.is_object(), src, ": expected a JSON object");

  for (const char* key : {"truncation", "padding"})
    if (const Json* v = root.find(key); v && !v->is_null()) unsupported(src, key, "set it to null");

  // model
  const Json& model = root.at("model", src);
  const std::string model_type = type_of(model, src + ": model");
  if (model_type != "BPE") unsupported(src, "model type " + model_type, "only BPE is");
  const std::string mwhere = src + ": model";
  if (flag(model, "byte_fallback", false, mwhere)) unsupported(src, "model.byte_fallback true");
  if (flag(model, "fuse_unk", false, mwhere)) unsupported(src, "model.fuse_unk true");
  if (const Json* d = model.find("dropout"); d && !d->is_null())
    unsupported(src, "model.dropout (BPE dropout)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const Json* v = model.find(key); v && !v->is_null() && !v->as_string(mwhere).empty())
      unsupported(src, std::string("model.") + key);
  t.ignore_merges = flag(model, "ignore_merges", false, mwhere);

  int32_t max_id = -1;
  for (const auto& [token, id_json] : model.at("vocab", mwhere).as_object(mwhere + ".vocab")) {
    const int64_t id = id_json.as_int64(mwhere + ".vocab." + token);
    MOP_USER_CHECK(id >= 0 && id < INT32_MAX, mwhere, ".vocab: id ", id, " of '", token,
                   "' is out of range");
    t.vocab.emplace(token, int32_t(id));
    max_id = std::max(max_id, int32_t(id));
  }
  if (const Json* unk = model.find("unk_token"); unk && !unk->is_null()) {
    const std::string& u = unk->as_string(mwhere + ".unk_token");
    auto it = t.vocab.find(u);
    MOP_USER_CHECK(it != t.vocab.end(), mwhere, ".unk_token '", u, "' is not in the vocab");
    t.unk_id = it->second;
  }
  const auto& merges = model.at("merges", mwhere).as_array(mwhere + ".merges");
  for (size_t rank = 0; rank < merges.size(); ++rank) {
    const std::string where = mwhere + ".merges[" + std::to_string(rank) + "]";
    std::string a, b;
    if (merges[rank].is_string()) {  // "a b", the older form
      const std::string& m = merges[rank].as_string(where);
      const size_t sp = m.find(' ');
      MOP_USER_CHECK(sp != std::string::npos && m.find(' ', sp + 1) == std::string::npos, where,
                     ": expected \"left right\", got \"", m, "\"");
      a = m.substr(0, sp), b = m.substr(sp + 1);
    } else {
      const auto& pair = merges[rank].as_array(where);
      MOP_USER_CHECK(pair.size() == 2, where, ": expected [left, right]");
      a = pair[0].as_string(where), b = pair[1].as_string(where);
    }
    auto ia = t.vocab.find(a), ib = t.vocab.find(b), iab = t.vocab.find(a + b);
    MOP_USER_CHECK(ia != t.vocab.end() && ib != t.vocab.end(), where, ": '", a, "' or '", b,
                   "' is not in the vocab");
    MOP_USER_CHECK(iab != t.vocab.end(), where, ": the merged token '", a + b,
                   "' is not in the vocab");
    const uint64_t key = uint64_t(uint32_t(ia->second)) << 32 | uint32_t(ib->second);
    t.merges.emplace(key, std::pair{int32_t(rank), iab->second});  // the first rank wins
  }

  // added tokens
  if (const Json* list = root.find("added_tokens"); list && !list->is_null()) {
    const auto& arr = list->as_array(src + ": added_tokens");
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string where = src + ": added_tokens[" + std::to_string(i) + "]";
      AddedToken a;
      a.content = arr[i].at("content", where).as_string(where + ".content");
      const int64_t id = arr[i].at("id", where).as_int64(where + ".id");
      MOP_USER_CHECK(id >= 0 && id < INT32_MAX, where, ": id ", id, " is out of range");
      MOP_USER_CHECK(!a.content.empty(), where, ": empty content");
      a.id = int32_t(id);
      a.special = flag(arr[i], "special", false, where);
      a.lstrip = flag(arr[i], "lstrip", false, where);
      a.rstrip = flag(arr[i], "rstrip", false, where);
      a.normalized = flag(arr[i], "normalized", !a.special, where);
      if (flag(arr[i], "single_word", false, where))
        unsupported(src, "added token '" + a.content + "' with single_word true");
      max_id = std::max(max_id, a.id);
      t.added_ids[a.content] = a.id;
      t.added.push_back(std::move(a));
    }
  }
  t.index_added();

  // normalizer
  if (const Json* n = root.find("normalizer"); n && !n->is_null()) {
    const std::string type = type_of(*n, src + ": normalizer");
    if (type != "NFC") unsupported(src, "normalizer " + type, "only null and NFC are");
    t.nfc = true;
  }

  // pre-tokenizer: ByteLevel, or Sequence[Split..., ByteLevel(use_regex=false)]
  const Json* pre = root.find("pre_tokenizer");
  if (!pre || pre->is_null())
    unsupported(src, "pre_tokenizer null (byte-level BPE needs ByteLevel)");
  std::vector<const Json*> stages;
  if (type_of(*pre, src + ": pre_tokenizer") == "Sequence") {
    for (const Json& s : pre->at("pretokenizers", src + ": pre_tokenizer").as_array(src))
      stages.push_back(&s);
  } else {
    stages.push_back(pre);
  }
  for (size_t i = 0; i < stages.size(); ++i) {
    const Json& s = *stages[i];
    const std::string where = src + ": pre_tokenizer";
    const std::string type = type_of(s, where);
    const bool last = i + 1 == stages.size();
    if (type == "Split" && !last) {
      const std::string behavior = s.at("behavior", where).as_string(where + ".behavior");
      if (behavior != "Isolated") unsupported(src, "pre_tokenizer Split behavior " + behavior);
      if (flag(s, "invert", false, where)) unsupported(src, "pre_tokenizer Split with invert true");
      const Json& pattern = s.at("pattern", where);
      const Json* regex = pattern.find("Regex");
      if (!regex) unsupported(src, "pre_tokenizer Split with a String pattern (only Regex is)");
      t.splits.push_back(compile_regex(regex->as_string(where), where + " Split"));
    } else if (type == "ByteLevel" && last) {
      t.add_prefix_space = flag(s, "add_prefix_space", true, where);
      if (flag(s, "use_regex", true, where))
        t.byte_level_regex = compile_regex(kGpt2Regex, where + " ByteLevel");
    } else if (type == "Split" || type == "ByteLevel") {
      unsupported(src, "pre_tokenizer " + type + " in this position",
                  "supported: ByteLevel, or a Sequence of Split stages ending in ByteLevel");
    } else {
      unsupported(src, "pre_tokenizer " + type,
                  "supported: ByteLevel, or a Sequence of Split stages ending in ByteLevel");
    }
  }

  // decoder and post-processor
  if (const Json* d = root.find("decoder"); d && !d->is_null()) {
    const std::string type = type_of(*d, src + ": decoder");
    if (type != "ByteLevel") unsupported(src, "decoder " + type, "only null and ByteLevel are");
  }
  if (const Json* p = root.find("post_processor"); p && !p->is_null())
    check_post_processor(*p, src);

  t.id_to_token.assign(size_t(max_id) + 1, std::string());
  t.is_special.assign(size_t(max_id) + 1, false);
  for (const auto& [token, id] : t.vocab) t.id_to_token[size_t(id)] = token;
  for (const AddedToken& a : t.added) {
    t.id_to_token[size_t(a.id)] = a.content;
    t.is_special[size_t(a.id)] = a.special;
  }
  const std::vector<uint32_t> alphabet = bytes_to_unicode();
  t.byte_char.resize(256);
  for (uint32_t b = 0; b < 256; ++b) {
    append_utf8(t.byte_char[b], alphabet[b]);
    t.char_byte[alphabet[b]] = uint8_t(b);
  }
  return Tokenizer(std::move(impl));
}

// ---- encode / decode -----------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text) const {
  const Impl& t = *impl_;
  for (size_t i = 0; i < text.size();) {
    const int len = utf8_seq_len(text, i);
    MOP_USER_CHECK(len > 0, "tokenizer: text is not valid UTF-8 at byte ", i);
    i += size_t(len);
  }
  std::vector<int32_t> ids;
  std::vector<Segment> raw, norm;
  t.split_added(text, /*normalized_pass=*/false, raw);
  for (const Segment& r : raw) {
    if (r.added_id >= 0) {
      ids.push_back(r.added_id);
      continue;
    }
    const std::string normalized = t.normalize(r.text);
    norm.clear();
    t.split_added(normalized, /*normalized_pass=*/true, norm);
    for (const Segment& n : norm) {
      if (n.added_id >= 0)
        ids.push_back(n.added_id);
      else
        t.pre_tokenize(n.text, ids);
    }
  }
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& t = *impl_;
  std::string bytes;
  for (int32_t id : ids) {
    MOP_USER_CHECK(
        id >= 0 && size_t(id) < t.id_to_token.size() && !t.id_to_token[size_t(id)].empty(),
        t.source, ": decode: id ", id, " is not in the vocabulary");
    if (skip_special && t.is_special[size_t(id)]) continue;
    const std::string& token = t.id_to_token[size_t(id)];
    // ByteLevel decoder: a token wholly in the alphabet gives its bytes, any other its UTF-8.
    std::string mapped;
    bool in_alphabet = true;
    for (size_t i = 0; i < token.size() && in_alphabet;) {
      const int len = utf8_seq_len(token, i);
      auto it = len > 0 ? t.char_byte.find(decode_utf8_at(token, i, len)) : t.char_byte.end();
      in_alphabet = it != t.char_byte.end();
      if (in_alphabet) mapped += char(it->second);
      i += size_t(std::abs(len));
    }
    bytes += in_alphabet ? mapped : token;
  }
  // String::from_utf8_lossy: each maximal invalid prefix becomes one U+FFFD.
  std::string out;
  out.reserve(bytes.size());
  for (size_t i = 0; i < bytes.size();) {
    const int len = utf8_seq_len(bytes, i);
    if (len > 0)
      out.append(bytes, i, size_t(len));
    else
      append_utf8(out, 0xFFFD);
    i += size_t(std::abs(len));
  }
  return out;
}

int64_t Tokenizer::vocab_size() const {
  return int64_t(impl_->id_to_token.size());
}

std::optional<int32_t> Tokenizer::token_id(std::string_view token) const {
  const std::string key(token);
  if (auto it = impl_->added_ids.find(key); it != impl_->added_ids.end()) return it->second;
  if (auto it = impl_->vocab.find(key); it != impl_->vocab.end()) return it->second;
  return std::nullopt;
}

}  // namespace mop
