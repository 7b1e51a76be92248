// BPE tokenizer from a Hugging Face tokenizer.json. encode() follows the `tokenizers` package
// step by step: added tokens are cut out of the raw text (leftmost, longest first; the
// normalized=false ones before normalization, the others, themselves normalized, after), the rest
// is normalized (NFC via ICU, Prepend, Replace), pre-tokenized (the ByteLevel stage with its
// regexes in PCRE2, UTF + UCP, JIT, and GPT-2's bytes_to_unicode alphabet; Metaspace; or none),
// mapped to vocabulary symbols (a character that is not one becomes its <0xXX> byte tokens under
// byte_fallback, else unk) and merged by rank; the post-processor's template adds its tokens.
// decode() runs the file's decoder chain over the tokens.
#include "data/tokenizer.h"

#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/unorm2.h>
#include <unicode/ustring.h>

#include <algorithm>
#include <array>
#include <climits>
#include <cstdlib>
#include <iterator>
#include <mutex>
#include <queue>
#include <unordered_map>
#include <unordered_set>
#include <utility>

#include "ckpt/json.h"
#include "core/error.h"
#include "core/small_file.h"

namespace mop {
namespace {

// GPT-2's split regex, what ByteLevel(use_regex=true) uses.
constexpr std::string_view kGpt2Regex =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
// The BPE cache stops growing here (the `tokenizers` default capacity is 10'000 words), and keeps
// no word longer than this (without a pre-tokenizer a "word" is a whole piece of text).
constexpr size_t kMaxCachedWords = 100'000;
constexpr size_t kMaxCachedWordBytes = 256;
// Token ids (vocab, added tokens, the template's) must be below this: 64 times the largest
// vocabulary in use (Gemma 3's 262,144). Loading allocates a table of max id + 1 entries, so an id
// near INT32_MAX in a 60-byte file would ask for 64 GB.
constexpr int64_t kMaxTokenIds = int64_t(1) << 24;

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
  std::string pattern, where;  // for errors: the tokenizer file's pattern and where it is
  Regex() = default;
  Regex(const Regex&) = delete;
  Regex(Regex&& o) noexcept
      : code(std::exchange(o.code, nullptr)),
        pattern(std::move(o.pattern)),
        where(std::move(o.where)) {}
  Regex& operator=(Regex&& o) noexcept {
    std::swap(code, o.code);
    std::swap(pattern, o.pattern);
    std::swap(where, o.where);
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
  re.pattern = std::string(pattern);
  re.where = std::string(where);
  return re;
}

// A pattern that backtracks without end on some text (nested quantifiers) stops at one of PCRE2's
// limits; that is the tokenizer file's doing, so it is a UserError naming the file and pattern.
[[noreturn]] void match_failed(const Regex& re, int rc) {
  const char* limit = rc == PCRE2_ERROR_MATCHLIMIT       ? "match limit"
                      : rc == PCRE2_ERROR_DEPTHLIMIT     ? "depth limit"
                      : rc == PCRE2_ERROR_HEAPLIMIT      ? "heap limit"
                      : rc == PCRE2_ERROR_JIT_STACKLIMIT ? "JIT stack limit"
                                                         : nullptr;
  PCRE2_UCHAR msg[256];
  pcre2_get_error_message(rc, msg, sizeof msg);
  MOP_CHECK(limit, "pcre2_match failed: ", rc, " (", reinterpret_cast<const char*>(msg), ")");
  throw_user_error(re.where, ": the regex '", re.pattern, "' hit PCRE2's ", limit, " (error ", rc,
                   ") on a piece of the text: it backtracks too much (nested quantifiers?); "
                   "simplify the pattern in the tokenizer file");
}

// Splits `text` into the matches of `re` and the gaps between them ("Isolated"), empty pieces
// dropped. Offsets are into `text`.
void split_isolated(const Regex& re, std::string_view text, std::vector<std::string_view>& out) {
  std::unique_ptr<pcre2_match_data, decltype(&pcre2_match_data_free)> md_owner(
      pcre2_match_data_create_from_pattern(re.code, nullptr), &pcre2_match_data_free);
  pcre2_match_data* md = md_owner.get();
  MOP_CHECK(md, "pcre2_match_data_create_from_pattern: out of memory");
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0, gap = 0;
  while (pos < text.size()) {
    const int rc = pcre2_match(re.code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, md, nullptr);
    if (rc == PCRE2_ERROR_NOMATCH) break;
    if (rc <= 0) match_failed(re, rc);
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
  if (gap < text.size()) out.push_back(text.substr(gap));
}

// Replaces every occurrence of `from` (non-empty) in `s` by `to`, left to right, in one pass.
void replace_all(std::string& s, std::string_view from, std::string_view to) {
  size_t at = s.find(from);
  if (at == std::string::npos) return;
  std::string out;
  out.reserve(s.size() + (to.size() > from.size() ? s.size() / 4 : 0));
  size_t done = 0;
  for (; at != std::string::npos; at = s.find(from, done)) {
    out.append(s, done, at - done);
    out += to;
    done = at + from.size();
  }
  out.append(s, done);
  s.swap(out);
}

// String::from_utf8_lossy: each maximal invalid prefix becomes one U+FFFD.
std::string utf8_lossy(std::string_view bytes) {
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

std::string nfc(std::string_view text) {
  if (std::all_of(text.begin(), text.end(), [](char c) { return uint8_t(c) < 0x80; }))
    return std::string(text);
  UErrorCode status = U_ZERO_ERROR;
  const UNormalizer2* norm = unorm2_getNFCInstance(&status);
  MOP_CHECK(U_SUCCESS(status), "ICU NFC: ", u_errorName(status));
  MOP_USER_CHECK(text.size() < size_t(INT32_MAX / 2), "a text of ", text.size(), " bytes is too long to normalise "
                 "(NFC) in one piece: at most ", INT32_MAX / 2 - 1, " bytes per document or line");
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

// The byte a "<0xXX>" token stands for as the ByteFallback decoder reads it (u8::from_str_radix
// of the two characters after "<0x", which also takes "+X"), or -1 for any other token.
int byte_token_value(std::string_view token) {
  if (token.size() != 6 || !token.starts_with("<0x") || token[5] != '>') return -1;
  auto hex = [](char c) {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (token[3] == '+') return hex(token[4]);
  const int hi = hex(token[3]), lo = hex(token[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

struct AddedToken {
  std::string content;
  std::string pattern;  // what encode matches: the content, normalized for normalized=true tokens
  int32_t id = 0;
  bool special = false, lstrip = false, rstrip = false, normalized = false;
};

// Piece of the text between encode's steps: either an added token's id or text still to encode.
struct Segment {
  std::string_view text;
  int32_t added_id = -1;
};

// One normalizer of the chain: NFC, Prepend(text) (to a non-empty text) or Replace(text, content).
struct NormalizerStep {
  enum class Kind { Nfc, Prepend, Replace } kind;
  std::string text, content;
};

enum class PrependScheme { Always, First, Never };

// Metaspace: spaces become `replacement`, which is prepended (always, to the text's first piece
// only, or never) and, with `split`, starts a new word wherever it occurs.
struct Metaspace {
  std::string replacement;
  PrependScheme scheme = PrependScheme::Always;
  bool split = true;
};

// One decoder of the chain; each maps the whole token list to a new one (the package's
// decode_chain), and decode() joins the last list.
struct DecoderStep {
  enum class Kind { ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace } kind = Kind::Fuse;
  std::string text, content;   // Replace: text → content; Strip: content, one character
  size_t start = 0, stop = 0;  // Strip: at most this many `content` characters off each end
  Metaspace metaspace;
};

enum class PreTokenizer { None, ByteLevel, Metaspace };

}  // namespace

struct Tokenizer::Impl {
  std::string source;
  std::unordered_map<std::string, int32_t> vocab;
  std::vector<std::string> id_to_token;  // vocab and added tokens; "" for ids with neither
  std::vector<bool> is_special;          // what decode(skip_special=true) leaves out
  // (left id << 32 | right id) → (rank, merged id)
  std::unordered_map<uint64_t, std::pair<int32_t, int32_t>> merges;
  std::optional<int32_t> unk_id;
  bool ignore_merges = false, fuse_unk = false, byte_fallback = false;
  std::array<int32_t, 256> byte_token;  // byte → id of the vocab's "<0xXX>", -1 when missing

  std::vector<AddedToken> added;
  std::unordered_map<std::string, int32_t> added_ids;
  // Added tokens by first byte, longest first, for the raw (normalized=false) and normalized pass.
  std::vector<std::vector<const AddedToken*>> raw_by_byte, norm_by_byte;

  std::vector<NormalizerStep> normalizers;
  PreTokenizer pre = PreTokenizer::None;
  std::vector<Regex> splits;  // Split pre-tokenizers, in order, before the byte-level stage
  std::optional<Regex> byte_level_regex;
  bool add_prefix_space = false;
  Metaspace metaspace;

  std::optional<std::vector<DecoderStep>> decoders;  // nullopt: no decoder
  std::vector<int32_t> prefix, suffix;               // the post-processor's single template

  std::vector<std::string> byte_char;               // byte → its alphabet character (UTF-8)
  std::unordered_map<uint32_t, uint8_t> char_byte;  // alphabet code point → byte

  mutable std::mutex cache_mutex;
  mutable std::unordered_map<std::string, std::vector<int32_t>> cache;

  void index_added();
  void split_added(std::string_view text, bool normalized_pass, std::vector<Segment>& out) const;
  std::string normalize(std::string_view text) const;
  void pre_tokenize(std::string_view text, bool at_start, std::vector<int32_t>& ids) const;
  void bpe(const std::string& word, std::vector<int32_t>& ids) const;
  std::vector<int32_t> symbols_of(const std::string& word) const;
  void merge(std::vector<int32_t>& symbols) const;
  void run_decoder(const DecoderStep& d, std::vector<std::string>& tokens) const;
};

void Tokenizer::Impl::index_added() {
  raw_by_byte.assign(256, {});
  norm_by_byte.assign(256, {});
  for (const AddedToken& t : added)
    (t.normalized ? norm_by_byte : raw_by_byte)[uint8_t(t.pattern[0])].push_back(&t);
  for (auto* table : {&raw_by_byte, &norm_by_byte})
    for (auto& bucket : *table)
      std::stable_sort(bucket.begin(), bucket.end(), [](const AddedToken* a, const AddedToken* b) {
        return a->pattern.size() > b->pattern.size();
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
      if (text.compare(pos, t->pattern.size(), t->pattern) == 0) {
        hit = t;
        break;
      }
    }
    if (!hit) {
      ++pos;
      continue;
    }
    size_t start = pos, stop = pos + hit->pattern.size();
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
  std::string s(text);
  for (const NormalizerStep& n : normalizers) {
    switch (n.kind) {
      case NormalizerStep::Kind::Nfc:
        s = nfc(s);
        break;
      case NormalizerStep::Kind::Prepend:
        if (!s.empty()) s.insert(0, n.text);
        break;
      case NormalizerStep::Kind::Replace:
        replace_all(s, n.text, n.content);
        break;
    }
  }
  return s;
}

// `at_start`: the piece begins the original text (Metaspace's prepend_scheme "first").
void Tokenizer::Impl::pre_tokenize(std::string_view text, bool at_start,
                                   std::vector<int32_t>& ids) const {
  if (pre == PreTokenizer::None) {
    bpe(std::string(text), ids);
    return;
  }
  if (pre == PreTokenizer::Metaspace) {
    const std::string& rep = metaspace.replacement;
    std::string s(text);
    replace_all(s, " ", rep);
    const bool prepend = metaspace.scheme == PrependScheme::Always ||
                         (metaspace.scheme == PrependScheme::First && at_start);
    if (prepend && !s.starts_with(rep)) s.insert(0, rep);
    if (!metaspace.split) {
      bpe(s, ids);
      return;
    }
    // SplitDelimiterBehavior::MergedWithNext: each replacement character begins a word.
    size_t begin = 0;
    for (size_t at = s.find(rep); at != std::string::npos; at = s.find(rep, at + rep.size())) {
      if (at == begin) continue;
      bpe(s.substr(begin, at - begin), ids);
      begin = at;
    }
    bpe(s.substr(begin), ids);
    return;
  }
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

void Tokenizer::Impl::bpe(const std::string& word, std::vector<int32_t>& ids) const {
  if (word.empty()) return;
  if (ignore_merges) {
    if (auto it = vocab.find(word); it != vocab.end()) {
      ids.push_back(it->second);
      return;
    }
  }
  const bool cacheable = word.size() <= kMaxCachedWordBytes;
  if (cacheable) {
    std::lock_guard lock(cache_mutex);
    if (auto it = cache.find(word); it != cache.end()) {
      ids.insert(ids.end(), it->second.begin(), it->second.end());
      return;
    }
  }
  std::vector<int32_t> symbols = symbols_of(word);
  merge(symbols);
  ids.insert(ids.end(), symbols.begin(), symbols.end());
  if (!cacheable) return;
  std::lock_guard lock(cache_mutex);
  if (cache.size() < kMaxCachedWords) cache.emplace(word, std::move(symbols));
}

// BPE::merge_word before the merges: each character's vocab id; for one not in the vocab, under
// byte_fallback its UTF-8 bytes' <0xXX> ids when all exist, else unk (a run of them one unk under
// fuse_unk). As in the package, a pending unk is written only at the next character found in the
// vocab (or the end): byte tokens of a character in between come before it.
std::vector<int32_t> Tokenizer::Impl::symbols_of(const std::string& word) const {
  std::vector<int32_t> symbols;
  bool unk_pending = false;
  std::string ch;
  for (size_t i = 0; i < word.size();) {
    const int len = utf8_seq_len(word, i);
    MOP_CHECK(len > 0);
    ch.assign(word, i, size_t(len));
    i += size_t(len);
    if (auto it = vocab.find(ch); it != vocab.end()) {
      if (unk_pending) symbols.push_back(*unk_id);
      unk_pending = false;
      symbols.push_back(it->second);
      continue;
    }
    if (byte_fallback &&
        std::all_of(ch.begin(), ch.end(), [&](char c) { return byte_token[uint8_t(c)] >= 0; })) {
      for (char c : ch) symbols.push_back(byte_token[uint8_t(c)]);
      continue;
    }
    if (!unk_id) continue;  // no unk: the character is dropped
    if (unk_pending && !fuse_unk) symbols.push_back(*unk_id);
    unk_pending = true;
  }
  if (unk_pending) symbols.push_back(*unk_id);
  return symbols;
}

// Word::merge_all: merges adjacent symbols, lowest rank first and leftmost among equal ranks,
// through a priority queue of candidate pairs (entries made stale by an earlier merge are
// skipped), so a long word costs O(n log n).
void Tokenizer::Impl::merge(std::vector<int32_t>& symbols) const {
  const size_t n = symbols.size();
  if (n < 2 || merges.empty()) return;
  struct Candidate {
    int32_t rank, pos, merged;
  };
  auto later = [](const Candidate& a, const Candidate& b) {
    return a.rank != b.rank ? a.rank > b.rank : a.pos > b.pos;
  };
  std::priority_queue<Candidate, std::vector<Candidate>, decltype(later)> queue(later);
  auto find = [&](int32_t left, int32_t right) {
    auto it = merges.find(uint64_t(uint32_t(left)) << 32 | uint32_t(right));
    return it == merges.end() ? nullptr : &it->second;
  };
  std::vector<int32_t> prev(n), next(n);
  std::vector<bool> alive(n, true);
  for (size_t i = 0; i < n; ++i) {
    prev[i] = int32_t(i) - 1;
    next[i] = i + 1 < n ? int32_t(i + 1) : -1;
    if (i + 1 < n)
      if (const auto* m = find(symbols[i], symbols[i + 1]))
        queue.push({m->first, int32_t(i), m->second});
  }
  while (!queue.empty()) {
    const Candidate top = queue.top();
    queue.pop();
    const int32_t pos = top.pos, right = next[size_t(pos)];
    if (!alive[size_t(pos)] || right < 0) continue;
    const auto* m = find(symbols[size_t(pos)], symbols[size_t(right)]);
    if (!m || m->second != top.merged) continue;  // the pair changed since it was queued
    symbols[size_t(pos)] = top.merged;
    alive[size_t(right)] = false;
    const int32_t after = next[size_t(right)];
    next[size_t(pos)] = after;
    if (after >= 0) prev[size_t(after)] = pos;
    if (const int32_t before = prev[size_t(pos)]; before >= 0)
      if (const auto* l = find(symbols[size_t(before)], top.merged))
        queue.push({l->first, before, l->second});
    if (after >= 0)
      if (const auto* r = find(top.merged, symbols[size_t(after)]))
        queue.push({r->first, pos, r->second});
  }
  size_t kept = 0;
  for (size_t i = 0; i < n; ++i)
    if (alive[i]) symbols[kept++] = symbols[i];
  symbols.resize(kept);
}

void Tokenizer::Impl::run_decoder(const DecoderStep& d, std::vector<std::string>& tokens) const {
  switch (d.kind) {
    case DecoderStep::Kind::ByteLevel: {
      // A token wholly in the alphabet gives its bytes, any other its UTF-8; the bytes of all
      // tokens then become one text (from_utf8_lossy).
      std::string bytes;
      for (const std::string& token : tokens) {
        std::string mapped;
        bool in_alphabet = true;
        for (size_t i = 0; i < token.size() && in_alphabet;) {
          const int len = utf8_seq_len(token, i);
          auto it = len > 0 ? char_byte.find(decode_utf8_at(token, i, len)) : char_byte.end();
          in_alphabet = it != char_byte.end();
          if (in_alphabet) mapped += char(it->second);
          i += size_t(std::abs(len));
        }
        bytes += in_alphabet ? mapped : token;
      }
      tokens.assign(1, utf8_lossy(bytes));
      break;
    }
    case DecoderStep::Kind::Replace:
      for (std::string& token : tokens) replace_all(token, d.text, d.content);
      break;
    case DecoderStep::Kind::ByteFallback: {
      // Runs of <0xXX> tokens become their bytes' text when that is valid UTF-8, else one U+FFFD
      // per token of the run.
      std::vector<std::string> out;
      std::string run;
      auto flush = [&] {
        if (run.empty()) return;
        if (utf8_lossy(run) == run) {
          out.push_back(run);
        } else {
          for (size_t k = 0; k < run.size(); ++k) out.emplace_back("\xef\xbf\xbd");
        }
        run.clear();
      };
      for (std::string& token : tokens) {
        if (const int b = byte_token_value(token); b >= 0) {
          run += char(b);
          continue;
        }
        flush();
        out.push_back(std::move(token));
      }
      flush();
      tokens.swap(out);
      break;
    }
    case DecoderStep::Kind::Fuse: {
      std::string all;
      for (const std::string& token : tokens) all += token;
      tokens.assign(1, std::move(all));
      break;
    }
    case DecoderStep::Kind::Strip:
      for (std::string& token : tokens) {
        const std::string& c = d.content;
        size_t begin = 0, end = token.size();
        for (size_t k = 0; k < d.start && token.compare(begin, c.size(), c) == 0; ++k)
          begin += c.size();
        for (size_t k = 0; k < d.stop && end >= begin + c.size() &&
                           token.compare(end - c.size(), c.size(), c) == 0;
             ++k)
          end -= c.size();
        token = token.substr(begin, end - begin);
      }
      break;
    case DecoderStep::Kind::Metaspace:
      // The replacement is a space again, except in the first token (all of its replacement
      // characters are dropped there, as the package does) unless prepend_scheme is "never".
      for (size_t i = 0; i < tokens.size(); ++i)
        replace_all(tokens[i], d.metaspace.replacement,
                    i == 0 && d.metaspace.scheme != PrependScheme::Never ? "" : " ");
      break;
  }
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

// A Replace's pattern: {"String": "..."}; a Regex pattern is refused.
std::string string_pattern(const Json& j, const std::string& src, const std::string& part) {
  const std::string where = src + ": " + part;
  const Json& pattern = j.at("pattern", where);
  const Json* s = pattern.find("String");
  if (!s) unsupported(src, part + " with a Regex pattern", "only a String pattern is");
  const std::string& text = s->as_string(where + ".pattern.String");
  MOP_USER_CHECK(!text.empty(), where, ": empty pattern");
  return text;
}

// A string that must be one character (Rust's char): Metaspace's replacement, Strip's content.
std::string one_char(const Json& j, std::string_view key, const std::string& where) {
  const std::string& s = j.at(key, where).as_string(where + "." + std::string(key));
  MOP_USER_CHECK(!s.empty() && utf8_seq_len(s, 0) == int(s.size()), where, ".", key,
                 ": expected one character, got \"", s, "\"");
  return s;
}

void read_normalizer(const Json& n, const std::string& src, std::vector<NormalizerStep>& out) {
  const std::string where = src + ": normalizer";
  const std::string type = type_of(n, where);
  if (type == "Sequence") {
    for (const Json& m : n.at("normalizers", where).as_array(where + ".normalizers"))
      read_normalizer(m, src, out);
  } else if (type == "NFC") {
    out.push_back({NormalizerStep::Kind::Nfc, "", ""});
  } else if (type == "Prepend") {
    out.push_back(
        {NormalizerStep::Kind::Prepend, n.at("prepend", where).as_string(where + ".prepend"), ""});
  } else if (type == "Replace") {
    out.push_back({NormalizerStep::Kind::Replace, string_pattern(n, src, "normalizer Replace"),
                   n.at("content", where).as_string(where + ".content")});
  } else {
    unsupported(src, "normalizer " + type,
                "supported: NFC, Prepend, Replace with a String pattern, and a Sequence of them");
  }
}

// Metaspace's fields (pre-tokenizer and decoder alike), the older add_prefix_space form included.
Metaspace read_metaspace(const Json& j, const std::string& where) {
  Metaspace m;
  m.replacement = one_char(j, "replacement", where);
  const Json* scheme = j.find("prepend_scheme");
  const std::string s = scheme && !scheme->is_null() ? scheme->as_string(where) : "always";
  if (s == "always")
    m.scheme = PrependScheme::Always;
  else if (s == "first")
    m.scheme = PrependScheme::First;
  else if (s == "never")
    m.scheme = PrependScheme::Never;
  else
    throw_user_error(where, ".prepend_scheme: expected always, first or never, got \"", s, "\"");
  MOP_USER_CHECK(flag(j, "add_prefix_space", true, where) || m.scheme == PrependScheme::Never,
                 where, ": add_prefix_space false contradicts prepend_scheme ", s);
  m.split = flag(j, "split", true, where);
  return m;
}

void read_decoder(const Json& d, const std::string& src, std::vector<DecoderStep>& out) {
  const std::string where = src + ": decoder";
  const std::string type = type_of(d, where);
  DecoderStep step;
  if (type == "Sequence") {
    for (const Json& e : d.at("decoders", where).as_array(where + ".decoders"))
      read_decoder(e, src, out);
    return;
  } else if (type == "ByteLevel") {
    step.kind = DecoderStep::Kind::ByteLevel;
  } else if (type == "Replace") {
    step.kind = DecoderStep::Kind::Replace;
    step.text = string_pattern(d, src, "decoder Replace");
    step.content = d.at("content", where).as_string(where + ".content");
  } else if (type == "ByteFallback") {
    step.kind = DecoderStep::Kind::ByteFallback;
  } else if (type == "Fuse") {
    step.kind = DecoderStep::Kind::Fuse;
  } else if (type == "Strip") {
    step.kind = DecoderStep::Kind::Strip;
    step.content = one_char(d, "content", where + " Strip");
    const int64_t start = d.at("start", where).as_int64(where + ".start");
    const int64_t stop = d.at("stop", where).as_int64(where + ".stop");
    MOP_USER_CHECK(start >= 0 && stop >= 0, where, " Strip: start and stop must be ≥ 0");
    step.start = size_t(start), step.stop = size_t(stop);
  } else if (type == "Metaspace") {
    step.kind = DecoderStep::Kind::Metaspace;
    step.metaspace = read_metaspace(d, where + " Metaspace");
  } else {
    unsupported(src, "decoder " + type,
                "supported: ByteLevel, Replace, ByteFallback, Fuse, Strip, Metaspace and a "
                "Sequence of them");
  }
  out.push_back(std::move(step));
}

// Post-processors: ByteLevel changes only offsets; TemplateProcessing's single-sequence template
// gives the ids put before and after the text's (its pair template is for encoding two texts,
// which this class does not do); a Sequence applies each in turn, so a later template wraps the
// earlier one.
void read_post_processor(const Json& p, const std::string& src, std::vector<int32_t>& prefix,
                         std::vector<int32_t>& suffix) {
  const std::string where = src + ": post_processor";
  const std::string type = type_of(p, where);
  if (type == "ByteLevel") return;
  if (type == "Sequence") {
    for (const Json& q : p.at("processors", where).as_array(where + ".processors"))
      read_post_processor(q, src, prefix, suffix);
    return;
  }
  if (type != "TemplateProcessing")
    unsupported(src, "post_processor " + type,
                "supported: ByteLevel, TemplateProcessing and a Sequence of them");
  const std::string twhere = where + " TemplateProcessing";
  const Json* specials = p.find("special_tokens");
  std::vector<int32_t> before, after;
  int num_a = 0;
  for (const Json& piece : p.at("single", twhere).as_array(twhere + ".single")) {
    if (const Json* special = piece.find("SpecialToken")) {
      const std::string& name = special->at("id", twhere).as_string(twhere + ".single");
      const Json* entry = specials ? specials->find(name) : nullptr;
      MOP_USER_CHECK(entry, twhere, ": '", name, "' is not in special_tokens");
      for (const Json& id : entry->at("ids", twhere).as_array(twhere + ".special_tokens")) {
        const int64_t v = id.as_int64(twhere + ".special_tokens." + name);
        MOP_USER_CHECK(v >= 0 && v < kMaxTokenIds, twhere, ": id ", v, " of '", name,
                       "' is out of range (ids run from 0 to ", kMaxTokenIds - 1, ")");
        (num_a ? after : before).push_back(int32_t(v));
      }
    } else if (const Json* seq = piece.find("Sequence")) {
      const std::string& id = seq->at("id", twhere).as_string(twhere + ".single");
      if (id != "A")
        unsupported(
            src,
            "post_processor TemplateProcessing with Sequence " + id + " in its single template",
            "only Sequence A is");
      ++num_a;
    } else {
      throw_user_error(twhere, ".single: expected SpecialToken or Sequence entries");
    }
  }
  MOP_USER_CHECK(num_a == 1, twhere, ".single: expected Sequence A once, found it ", num_a,
                 " times");
  prefix.insert(prefix.begin(), before.begin(), before.end());
  suffix.insert(suffix.end(), after.begin(), after.end());
}

}  // namespace

Tokenizer::Tokenizer(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Tokenizer::Tokenizer(Tokenizer&&) noexcept = default;
Tokenizer& Tokenizer::operator=(Tokenizer&&) noexcept = default;
Tokenizer::~Tokenizer() = default;

Tokenizer Tokenizer::load(const std::filesystem::path& path) {
  return from_json_text(read_small_file(path, "tokenizer", kTokenizerFileCap), path.string());
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
  t.byte_fallback = flag(model, "byte_fallback", false, mwhere);
  t.fuse_unk = flag(model, "fuse_unk", false, mwhere);
  if (const Json* d = model.find("dropout"); d && !d->is_null())
    unsupported(src, "model.dropout (BPE dropout)");
  for (const char* key : {"continuing_subword_prefix", "end_of_word_suffix"})
    if (const Json* v = model.find(key); v && !v->is_null() && !v->as_string(mwhere).empty())
      unsupported(src, std::string("model.") + key);
  t.ignore_merges = flag(model, "ignore_merges", false, mwhere);

  int32_t max_id = -1;
  for (const auto& [token, id_json] : model.at("vocab", mwhere).as_object(mwhere + ".vocab")) {
    const int64_t id = id_json.as_int64(mwhere + ".vocab." + token);
    MOP_USER_CHECK(id >= 0 && id < kMaxTokenIds, mwhere, ".vocab: id ", id, " of '", token,
                   "' is out of range (ids run from 0 to ", kMaxTokenIds - 1, ")");
    // As for added tokens: decode spells a token by its text, and an empty one reads as no token.
    MOP_USER_CHECK(!token.empty(), mwhere, ".vocab: id ", id, " is the empty string");
    t.vocab.emplace(token, int32_t(id));
    max_id = std::max(max_id, int32_t(id));
  }
  if (const Json* unk = model.find("unk_token"); unk && !unk->is_null()) {
    const std::string& u = unk->as_string(mwhere + ".unk_token");
    auto it = t.vocab.find(u);
    MOP_USER_CHECK(it != t.vocab.end(), mwhere, ".unk_token '", u, "' is not in the vocab");
    t.unk_id = it->second;
  }
  for (int b = 0; b < 256; ++b) {
    static constexpr char kHex[] = "0123456789ABCDEF";
    const std::string name = std::string("<0x") + kHex[b >> 4] + kHex[b & 15] + ">";
    auto it = t.vocab.find(name);
    t.byte_token[size_t(b)] = it == t.vocab.end() ? -1 : it->second;
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

  // normalizer
  if (const Json* n = root.find("normalizer"); n && !n->is_null())
    read_normalizer(*n, src, t.normalizers);

  // added tokens; the normalized ones are matched in their normalized form
  if (const Json* list = root.find("added_tokens"); list && !list->is_null()) {
    const auto& arr = list->as_array(src + ": added_tokens");
    for (size_t i = 0; i < arr.size(); ++i) {
      const std::string where = src + ": added_tokens[" + std::to_string(i) + "]";
      AddedToken a;
      a.content = arr[i].at("content", where).as_string(where + ".content");
      const int64_t id = arr[i].at("id", where).as_int64(where + ".id");
      MOP_USER_CHECK(id >= 0 && id < kMaxTokenIds, where, ": id ", id,
                     " is out of range (ids run from 0 to ", kMaxTokenIds - 1, ")");
      MOP_USER_CHECK(!a.content.empty(), where, ": empty content");
      a.id = int32_t(id);
      a.special = flag(arr[i], "special", false, where);
      a.lstrip = flag(arr[i], "lstrip", false, where);
      a.rstrip = flag(arr[i], "rstrip", false, where);
      a.normalized = flag(arr[i], "normalized", !a.special, where);
      a.pattern = a.normalized ? t.normalize(a.content) : a.content;
      MOP_USER_CHECK(!a.pattern.empty(), where, ": the content normalizes to nothing");
      if (flag(arr[i], "single_word", false, where))
        unsupported(src, "added token '" + a.content + "' with single_word true");
      max_id = std::max(max_id, a.id);
      t.added_ids[a.content] = a.id;
      t.added.push_back(std::move(a));
    }
  }
  t.index_added();

  // pre-tokenizer: null, Metaspace, ByteLevel, or Sequence[Split..., ByteLevel(use_regex=false)]
  const std::string kPreHint =
      "supported: null, Metaspace, ByteLevel, or a Sequence of Split stages ending in ByteLevel";
  if (const Json* pre = root.find("pre_tokenizer"); pre && !pre->is_null()) {
    const std::string pwhere = src + ": pre_tokenizer";
    const std::string top = type_of(*pre, pwhere);
    std::vector<const Json*> stages;
    if (top == "Metaspace") {
      t.pre = PreTokenizer::Metaspace;
      t.metaspace = read_metaspace(*pre, pwhere + " Metaspace");
    } else if (top == "Sequence") {
      for (const Json& s : pre->at("pretokenizers", pwhere).as_array(pwhere + ".pretokenizers"))
        stages.push_back(&s);
    } else {
      stages.push_back(pre);
    }
    for (size_t i = 0; i < stages.size(); ++i) {
      const Json& s = *stages[i];
      const std::string type = type_of(s, pwhere);
      const bool last = i + 1 == stages.size();
      if (type == "Split" && !last) {
        const std::string behavior = s.at("behavior", pwhere).as_string(pwhere + ".behavior");
        if (behavior != "Isolated") unsupported(src, "pre_tokenizer Split behavior " + behavior);
        if (flag(s, "invert", false, pwhere))
          unsupported(src, "pre_tokenizer Split with invert true");
        const Json& pattern = s.at("pattern", pwhere);
        const Json* regex = pattern.find("Regex");
        if (!regex) unsupported(src, "pre_tokenizer Split with a String pattern (only Regex is)");
        t.splits.push_back(compile_regex(regex->as_string(pwhere), pwhere + " Split"));
      } else if (type == "ByteLevel" && last) {
        t.pre = PreTokenizer::ByteLevel;
        t.add_prefix_space = flag(s, "add_prefix_space", true, pwhere);
        if (flag(s, "use_regex", true, pwhere))
          t.byte_level_regex = compile_regex(kGpt2Regex, pwhere + " ByteLevel");
      } else if (type == "Split" || type == "ByteLevel" || type == "Metaspace") {
        unsupported(src, "pre_tokenizer " + type + " in this position", kPreHint);
      } else {
        unsupported(src, "pre_tokenizer " + type, kPreHint);
      }
    }
  }

  // decoder and post-processor
  if (const Json* d = root.find("decoder"); d && !d->is_null()) {
    t.decoders.emplace();
    read_decoder(*d, src, *t.decoders);
  }
  if (const Json* p = root.find("post_processor"); p && !p->is_null())
    read_post_processor(*p, src, t.prefix, t.suffix);

  t.id_to_token.assign(size_t(max_id) + 1, std::string());
  t.is_special.assign(size_t(max_id) + 1, false);
  for (const auto& [token, id] : t.vocab) t.id_to_token[size_t(id)] = token;
  // Decoding spells an added token as it is matched (a normalized one in its normalized form),
  // and skip_special drops the ids whose spelling is a special token's content (so not a special
  // token that normalization changed), as the package does.
  std::unordered_set<std::string> special_contents;
  for (const AddedToken& a : t.added) {
    t.id_to_token[size_t(a.id)] = a.pattern;
    if (a.special) special_contents.insert(a.content);
  }
  for (size_t id = 0; id < t.id_to_token.size(); ++id)
    t.is_special[id] = special_contents.count(t.id_to_token[id]) > 0;
  for (const auto* ids : {&t.prefix, &t.suffix})
    for (int32_t id : *ids)
      MOP_USER_CHECK(size_t(id) < t.id_to_token.size() && !t.id_to_token[size_t(id)].empty(), src,
                     ": post_processor: the template's id ", id, " is not in the vocabulary");
  const std::vector<uint32_t> alphabet = bytes_to_unicode();
  t.byte_char.resize(256);
  for (uint32_t b = 0; b < 256; ++b) {
    append_utf8(t.byte_char[b], alphabet[b]);
    t.char_byte[alphabet[b]] = uint8_t(b);
  }
  return Tokenizer(std::move(impl));
}

// ---- encode / decode -----------------------------------------------------------------------

std::vector<int32_t> Tokenizer::encode(std::string_view text, bool add_special_tokens) const {
  const Impl& t = *impl_;
  for (size_t i = 0; i < text.size();) {
    const int len = utf8_seq_len(text, i);
    MOP_USER_CHECK(len > 0, "tokenizer: text is not valid UTF-8 at byte ", i);
    i += size_t(len);
  }
  std::vector<int32_t> ids;
  if (add_special_tokens) ids = t.prefix;
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
        t.pre_tokenize(n.text, r.text.data() == text.data() && n.text.data() == normalized.data(),
                       ids);
    }
  }
  if (add_special_tokens) ids.insert(ids.end(), t.suffix.begin(), t.suffix.end());
  return ids;
}

std::string Tokenizer::decode(std::span<const int32_t> ids, bool skip_special) const {
  const Impl& t = *impl_;
  std::vector<std::string> tokens;
  tokens.reserve(ids.size());
  for (int32_t id : ids) {
    MOP_USER_CHECK(
        id >= 0 && size_t(id) < t.id_to_token.size() && !t.id_to_token[size_t(id)].empty(),
        t.source, ": decode: id ", id, " is not in the vocabulary");
    if (skip_special && t.is_special[size_t(id)]) continue;
    tokens.push_back(t.id_to_token[size_t(id)]);
  }
  std::string out;
  if (!t.decoders) {  // no decoder: the package joins the tokens with spaces
    for (size_t i = 0; i < tokens.size(); ++i) out += (i ? " " : "") + tokens[i];
    return out;
  }
  for (const DecoderStep& d : *t.decoders) t.run_decoder(d, tokens);
  for (const std::string& token : tokens) out += token;
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

const std::vector<int32_t>& Tokenizer::prefix_ids() const {
  return impl_->prefix;
}

const std::vector<int32_t>& Tokenizer::suffix_ids() const {
  return impl_->suffix;
}

}  // namespace mop
