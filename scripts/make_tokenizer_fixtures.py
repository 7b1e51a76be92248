#!/usr/bin/env python3
"""Writes tests/data/fixtures/tokenizer/<kind>/{tokenizer.json,expected.json,...}: small BPE
tokenizers trained with the Hugging Face `tokenizers` package (pip install tokenizers) on the first
~1 MB of data/kjv.txt plus a torture text, and the ids and decodings that package gives for ~30
test strings. tests/data/tokenizer_test.cpp checks that MoP's C++ tokenizer encodes every text to
exactly those ids and decodes them to exactly that text.

expected.json holds one case per text: "text" and "ids" (add_special_tokens=False), and where they
differ from their defaults "ids_special" (add_special_tokens=True; default ids), "decoded"
(decode(ids); default text), "decoded_skip" (decode(ids, skip_special_tokens=True); default
decoded), "decoded_special" and "decoded_special_skip" (the same for ids_special; defaults decoded
and decoded_skip).

  gpt2     ByteLevel(use_regex=True) pre-tokenizer, <|endoftext|>; merges in the [a, b] list form.
  qwen2    NFC normalizer, Split(Qwen2 regex, isolated) + ByteLevel(use_regex=False),
           <|endoftext|>, <|im_start|>, <|im_end|>; merges rewritten in the older "a b" form.
  llama3   no normalizer, Split(Llama 3 regex) + ByteLevel(use_regex=False), ignore_merges=true,
           one vocab word with no merge path (only ignore_merges reaches it), a non-special added
           token with lstrip/rstrip, a special token outside the byte-level alphabet; Llama 3's
           post-processor Sequence[ByteLevel, TemplateProcessing("<|begin_of_text|> $A")].
  llama2   SentencePiece-style BPE as Llama 2 and Mixtral ship it: byte_fallback, fuse_unk,
           <unk>/<s>/</s> then the 256 <0xXX> tokens, a small alphabet (so CJK, emoji and rare
           letters fall back to bytes); normalizer Sequence[Prepend("▁"), Replace(" ", "▁")], no
           pre-tokenizer, decoder Sequence[Replace("▁", " "), ByteFallback, Fuse, Strip(" ", 1, 0)],
           TemplateProcessing("<s> $A"); merges in the "a b" form; a normalized non-special added
           token (matched as "▁Jerusalem"). expected_decode.json: decodings of hand-picked token
           sequences (byte tokens that are not valid UTF-8, special tokens).
  metaspace  the same vocabulary in the newer converter's form: no normalizer, pre-tokenizer and
           decoder Metaspace(prepend_scheme="first", split=False),
           TemplateProcessing("<s> $A </s>"), merges as [a, b], [INST]/[/INST] special tokens
           with rstrip/lstrip. expected_variants.json: ids and decodings with prepend_scheme
           always/never, split true and the older {"add_prefix_space": true} spelling;
           expected_decode.json as for llama2.
  sp_unk   a hand-made byte-fallback vocabulary that lacks most <0xXX> tokens: unk, fuse_unk and
           their order against byte tokens, a normalized special token; expected.json also has
           "ids_no_fuse" (fuse_unk false) and "ids_no_unk" (no unk_token).

Run from the repository root; rerun only when the fixtures must change (CI reads the committed
files and needs no network). The output is deterministic.
"""
import json
import os

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        processors, trainers)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
OUT = os.path.join(ROOT, "tests", "data", "fixtures", "tokenizer")
VOCAB_SIZE = 2000
KJV_BYTES = 1_000_000

QWEN2_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
LLAMA3_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
                r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")

# Multilingual text, emoji with ZWJ sequences and skin tones, combining marks (decomposed é, so
# NFC changes it), tabs, runs of spaces and newlines, CRLF, digit runs, contractions, NEL, NBSP and
# other Unicode spaces, format characters, and special tokens inside text.
TORTURE = [
    "Hello, world! don't I'll we're they've she'd you'm IT'S DON'T",
    "中文测试：我爱北京天安门。繁體中文，標點符號！",
    "مرحبا بالعالم، هذا اختبار للنص العربي.",
    "नमस्ते दुनिया, यह हिंदी पाठ है।",
    "Emoji: 👨‍👩‍👧‍👦 family, 👍🏽 thumbs, 🏳️‍🌈 flag, 🧑🏿‍💻 coder, ❤️‍🔥",
    "Combining: e\u0301 a\u0300 o\u0308 n\u0303 — cafe\u0301 vs café, Z\u0351\u0352\u0353algo",
    "tabs\there\t\tand\t\t\tmore\t",
    "runs of spaces:  two   three    four          ten",
    "newlines\n\nthree\n\n\nand trailing spaces   \n  leading",
    "CRLF line one\r\nline two\r\n\r\nline four\r\n",
    "digits 1234567 and 3.14159, 1,000,000 and 2026-12-01",
    "odd spaces:\u00a0nbsp\u3000ideographic\u2009thin\u0085nel\u2028ls end",
    "nel runs:\u0085\u0085 x \u0085\u0085\u0085y!\u0085\u0085\n\u0085 \u00a0 \u3000z \u2028\u2029",
    "format chars: a \u180e\u180eb \u200bc \u200d\u2060d\ufeff",
    "<|endoftext|>",
    "before<|endoftext|>after <|endoftext|> spaced<|endoftext|><|endoftext|>",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n",
    "<|im_start <|im_end| |im_end|> <|endoftext",
    "<|begin_of_text|>In the beginning <|end_of_text|>",
    "mix <reserved>  x  <reserved>y<reserved>   z",
    "deepseek style<｜end▁of▁sentence｜>next <｜end▁of▁sentence｜ partial",
    "Jerusalem and  Jerusalem, JERUSALEM jerusalem's",
    "Ünïcödé ÅNGSTRÖM ﬁ ligature ſ long s 'ſ Kelvin K",
    "",
    " ",
    "\n",
    "a",
    "    indented code:\n\tif (x) { return y; }\n",
]

SPECIALS = {
    "gpt2": ["<|endoftext|>"],
    "qwen2": ["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
    "llama3": ["<|begin_of_text|>", "<|end_of_text|>"],
}


def kjv_text():
    with open(os.path.join(ROOT, "data", "kjv.txt"), encoding="utf-8") as f:
        return f.read(KJV_BYTES)


def build(kind, vocab_size=VOCAB_SIZE, texts=None):
    """A tokenizer of the `kind` form trained on `texts` (default: the fixtures' KJV + torture text)."""
    if kind == "gpt2":
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    else:
        tok = Tokenizer(models.BPE(ignore_merges=(kind == "llama3")))
        if kind == "qwen2":
            tok.normalizer = normalizers.NFC()
        regex = QWEN2_REGEX if kind == "qwen2" else LLAMA3_REGEX
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIALS[kind],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(texts if texts is not None else [kjv_text()] + TORTURE, trainer=trainer)
    spec = json.loads(tok.to_str())
    if kind == "qwen2":
        spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
    if kind == "llama3":
        vocab = spec["model"]["vocab"]
        for word in ["ĠJerusalem", "Jerusalem"]:
            if word not in vocab:
                vocab[word] = len(vocab)
        text = json.dumps(spec, ensure_ascii=False)
        tok = Tokenizer.from_str(text)
        tok.add_tokens([AddedToken("<reserved>", lstrip=True, rstrip=True, normalized=False)])
        # Not in the byte-level alphabet: decoding writes its UTF-8 as is.
        tok.add_special_tokens([AddedToken("<｜end▁of▁sentence｜>", normalized=False)])
        # Llama 3's post-processor: <|begin_of_text|> before the text with add_special_tokens.
        bos = ("<|begin_of_text|>", tok.token_to_id("<|begin_of_text|>"))
        tok.post_processor = processors.Sequence([
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(single="<|begin_of_text|> $A",
                                          pair="<|begin_of_text|> $A <|begin_of_text|>:1 $B:1",
                                          special_tokens=[bos]),
        ])
        spec = json.loads(tok.to_str())
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False)), spec


def test_texts():
    kjv = kjv_text()
    paragraphs = [p for p in kjv.split("\n\n") if len(p) > 200]
    # Chapter-long paragraphs cut to ~1 KB keep expected.json small.
    return TORTURE + [paragraphs[k][:1000] for k in (0, 7, 40, 90, 91)]


# SentencePiece-style BPE (Llama 2, Mistral, Mixtral).
SP_VOCAB_SIZE = 1500
SP_ALPHABET = 80  # the most frequent characters; the others fall back to <0xXX> byte tokens
SP_SPECIALS = ["<unk>", "<s>", "</s>"]
BYTE_TOKENS = [f"<0x{b:02X}>" for b in range(256)]
SP_TEMPLATES = {"llama2": ("<s> $A", "<s> $A <s>:1 $B:1"),
                "metaspace": ("<s> $A </s>", "<s> $A </s> <s>:1 $B:1 </s>:1")}
# More texts for the SentencePiece kinds: their special tokens inside text, spaces at the start,
# literal ▁ characters, byte-token look-alikes, rare ASCII letters (not in the alphabet).
SP_TEXTS = [
    "<s>[INST] Who begat Enos? [/INST] Seth begat Enos.</s>",
    "[INST]   spaced   [/INST]   out  ",
    "  two leading spaces, a literal ▁ and a ▁▁ run▁",
    "<unk> unk <s>  spaced </s>x</s>",
    "Jerusalem in Jerusalem, xJerusalem, Jerusalemite  Jerusalem",
    "QVX quiz: Zyxt and Qoph",
    "<0x41> looks like a byte token, <0xZZ> does not",
    "\u00e9t\u00e9 na\u00efve \u00a9 \u20ac 100 \U0001f600",
]


def sp_decoder():
    return decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                              decoders.Strip(content=" ", left=1, right=0)])


def build_sentencepiece(kind):
    # Trained on words cut at the metaspace, as SentencePiece learns them; the file then gets the
    # pre-tokenizer (or normalizer) of its kind.
    tok = Tokenizer(models.BPE(unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always",
                                                 split=True)
    trainer = trainers.BpeTrainer(vocab_size=SP_VOCAB_SIZE,
                                  special_tokens=SP_SPECIALS + BYTE_TOKENS,
                                  limit_alphabet=SP_ALPHABET, show_progress=False)
    tok.train_from_iterator(texts if texts is not None else [kjv_text()] + TORTURE, trainer=trainer)
    spec = json.loads(tok.to_str())
    # The byte tokens are vocabulary entries only, not added tokens.
    spec["added_tokens"] = [a for a in spec["added_tokens"] if a["content"] in SP_SPECIALS]
    if kind == "llama2":
        spec["normalizer"] = json.loads(normalizers.Sequence([
            normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")]).__getstate__())
        spec["pre_tokenizer"] = None
        spec["decoder"] = json.loads(sp_decoder().__getstate__())
        spec["model"]["merges"] = [" ".join(m) for m in spec["model"]["merges"]]
    else:
        spec["normalizer"] = None
        metaspace = dict(type="Metaspace", replacement="▁", prepend_scheme="first", split=False)
        spec["pre_tokenizer"] = metaspace
        spec["decoder"] = metaspace
    tok = Tokenizer.from_str(json.dumps(spec, ensure_ascii=False))
    if kind == "llama2":
        # Normalized, so matched in the normalized text: as "▁Jerusalem".
        tok.add_tokens([AddedToken("Jerusalem", normalized=True)])
    else:
        tok.add_special_tokens([AddedToken("[INST]", rstrip=True, normalized=False),
                                AddedToken("[/INST]", lstrip=True, normalized=False)])
        tok.add_tokens([AddedToken("Jerusalem", normalized=True)])
    single, pair = SP_TEMPLATES[kind]
    tok.post_processor = processors.TemplateProcessing(
        single=single, pair=pair, special_tokens=[(t, tok.token_to_id(t)) for t in ["<s>", "</s>"]])
    spec = json.loads(tok.to_str())
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False)), spec


def sp_unk_spec():
    # Only three byte tokens (é is C3 A9; € is E2 82 AC, of which only E2 is there).
    vocab = {"<unk>": 0, "<s>": 1, "▁": 2, "a": 3, "b": 4, "▁a": 5, "ab": 6, "▁ab": 7,
             "<0xC3>": 8, "<0xA9>": 9, "<0xE2>": 10}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[("▁", "a"), ("a", "b"), ("▁a", "b")],
                               unk_token="<unk>", fuse_unk=True, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.decoder = sp_decoder()
    tok.add_special_tokens(["<unk>", "<s>"])
    # A special token that is normalized: matched as "▁[X]", decoded so, and (its spelling then not
    # being a special token's) kept by skip_special_tokens.
    tok.add_special_tokens([AddedToken("[X]", normalized=True, special=True)])
    return json.loads(tok.to_str())


SP_UNK_TEXTS = ["cé", "cébé", "c€é", "é€c", "ab cd", "ccc a", "€", "a€€b", "ééc", "x y z", "é",
                "", "<unk>c<unk>", "a [X] b<s>", "a[X]"]


def case_for(tok, text):
    ids = tok.encode(text, add_special_tokens=False).ids
    ids_special = tok.encode(text, add_special_tokens=True).ids
    decoded = tok.decode(ids, skip_special_tokens=False)
    decoded_skip = tok.decode(ids, skip_special_tokens=True)
    case = {"text": text, "ids": ids}
    if ids_special != ids:
        case["ids_special"] = ids_special
    if decoded != text:  # NFC, a stripped leading space, U+FFFD
        case["decoded"] = decoded
    if decoded_skip != decoded:
        case["decoded_skip"] = decoded_skip
    if ids_special != ids:
        d = tok.decode(ids_special, skip_special_tokens=False)
        ds = tok.decode(ids_special, skip_special_tokens=True)
        if d != decoded:
            case["decoded_special"] = d
        if ds != decoded_skip:
            case["decoded_special_skip"] = ds
    return case


def decode_cases(tok):
    # Token sequences whose decoding shows ByteFallback's U+FFFD (one per byte token of a run that
    # is not valid UTF-8), the Strip of one leading space and special tokens.
    seqs = [["<0xE4>"], ["<0xE4>", "<0xB8>"], ["<0xE4>", "<0xB8>", "<0xAD>"],
            ["▁a", "<0xE4>", "<0xB8>", "▁b"], ["<0x41>", "<0xFF>", "<0x42>"],
            ["<0xF0>", "<0x9F>", "<0x98>", "<0x80>", "<0x80>"], ["<0xC3>", "<0xA9>", "<0xA9>"],
            ["<s>", "<0x20>", "▁a"], ["▁", "▁", "<0x0A>", "</s>"], ["</s>", "▁the"],
            ["<unk>", "▁a", "<unk>"], ["<0x20>", "▁"],
            ["▁the", "<s>", "<0xE2>", "<0x82>", "<0xAC>"]]
    cases = []
    for seq in seqs:
        ids = [tok.token_to_id(t) for t in seq]
        assert None not in ids, seq
        cases.append({"tokens": seq, "ids": ids,
                      "decoded": tok.decode(ids, skip_special_tokens=False),
                      "decoded_skip": tok.decode(ids, skip_special_tokens=True)})
    return cases


def metaspace_variants(spec, texts):
    variants = []
    for pre in [dict(type="Metaspace", replacement="▁", prepend_scheme="always", split=False),
                dict(type="Metaspace", replacement="▁", prepend_scheme="never", split=False),
                dict(type="Metaspace", replacement="▁", prepend_scheme="first", split=True),
                dict(type="Metaspace", replacement="▁", add_prefix_space=True)]:
        s = dict(spec, pre_tokenizer=pre, decoder=pre)
        tok = Tokenizer.from_str(json.dumps(s, ensure_ascii=False))
        cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids,
                  "decoded": tok.decode(tok.encode(t, add_special_tokens=False).ids,
                                        skip_special_tokens=False)} for t in texts]
        variants.append({"pre_tokenizer": pre, "cases": cases})
    return variants


def write(kind, name, obj):
    os.makedirs(os.path.join(OUT, kind), exist_ok=True)
    path = os.path.join(OUT, kind, name)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    print(f"{path}: {os.path.getsize(path)} bytes")
    return os.path.getsize(path)


def main():
    total = 0
    for kind in ["gpt2", "qwen2", "llama3"]:
        tok, spec = build(kind)
        total += write(kind, "tokenizer.json", spec)
        total += write(kind, "expected.json", [case_for(tok, t) for t in test_texts()])
    # gpt2 with ByteLevel add_prefix_space=true (the test flips the flag in the same file): the
    # space is prepended to each piece between added tokens.
    spec = json.load(open(os.path.join(OUT, "gpt2", "tokenizer.json"), encoding="utf-8"))
    spec["pre_tokenizer"]["add_prefix_space"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids}
             for t in ["a<|endoftext|>b", "In the", " In", "", "<|endoftext|> x", TORTURE[0]]]
    total += write("gpt2", "expected_add_prefix_space.json", cases)

    for kind in ["llama2", "metaspace"]:
        tok, spec = build_sentencepiece(kind)
        total += write(kind, "tokenizer.json", spec)
        total += write(kind, "expected.json", [case_for(tok, t) for t in test_texts() + SP_TEXTS])
        total += write(kind, "expected_decode.json", decode_cases(tok))
        if kind == "metaspace":
            texts = [TORTURE[0], TORTURE[4], TORTURE[8], "<s>x y", " leading", "a  b", "", "▁▁x ▁",
                     "[INST] hi [/INST] there"]
            total += write(kind, "expected_variants.json", metaspace_variants(spec, texts))

    spec = sp_unk_spec()
    total += write("sp_unk", "tokenizer.json", spec)
    variants = {"ids": spec}
    variants["ids_no_fuse"] = json.loads(json.dumps(spec))
    variants["ids_no_fuse"]["model"]["fuse_unk"] = False
    variants["ids_no_unk"] = json.loads(json.dumps(spec))
    variants["ids_no_unk"]["model"]["unk_token"] = None
    toks = {k: Tokenizer.from_str(json.dumps(v, ensure_ascii=False)) for k, v in variants.items()}
    cases = []
    for text in SP_UNK_TEXTS:
        case = {"text": text}
        for key, tok in toks.items():
            case[key] = tok.encode(text, add_special_tokens=False).ids
        case["decoded"] = toks["ids"].decode(case["ids"], skip_special_tokens=False)
        case["decoded_skip"] = toks["ids"].decode(case["ids"], skip_special_tokens=True)
        cases.append(case)
    total += write("sp_unk", "expected.json", cases)
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
