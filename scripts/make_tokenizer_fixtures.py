#!/usr/bin/env python3
"""Writes tests/data/fixtures/tokenizer/{gpt2,qwen2,llama3}/{tokenizer.json,expected.json}: small
byte-level BPE tokenizers trained with the Hugging Face `tokenizers` package (pip install
tokenizers) on the first ~1 MB of data/kjv.txt plus a torture text, and the ids that package gives
for ~30 test strings. tests/data/tokenizer_test.cpp checks that MoP's C++ tokenizer encodes every
text to exactly those ids and decodes them back to the text (or to "decoded", the package's
decoding, where NFC changed the text).

  gpt2   ByteLevel(use_regex=True) pre-tokenizer, <|endoftext|>; merges in the [a, b] list form.
  qwen2  NFC normalizer, Split(Qwen2 regex, isolated) + ByteLevel(use_regex=False), <|endoftext|>,
         <|im_start|>, <|im_end|>; merges rewritten in the older "a b" string form.
  llama3 no normalizer, Split(Llama 3 regex) + ByteLevel(use_regex=False), ignore_merges=true,
         one vocab word with no merge path (only ignore_merges reaches it), a non-special added
         token with lstrip/rstrip, a special token outside the byte-level alphabet.

Run from the repository root; rerun only when the fixtures must change (CI reads the committed
files and needs no network).
"""
import json
import os

from tokenizers import (AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers,
                        trainers)

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


def build(kind):
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
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIALS[kind],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator([kjv_text()] + TORTURE, trainer=trainer)
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
        spec = json.loads(tok.to_str())
    return Tokenizer.from_str(json.dumps(spec, ensure_ascii=False)), spec


def test_texts():
    kjv = kjv_text()
    paragraphs = [p for p in kjv.split("\n\n") if len(p) > 200]
    # Chapter-long paragraphs cut to ~1 KB keep expected.json small.
    return TORTURE + [paragraphs[k][:1000] for k in (0, 7, 40, 90, 91)]


def main():
    total = 0
    for kind in ["gpt2", "qwen2", "llama3"]:
        tok, spec = build(kind)
        cases = []
        for text in test_texts():
            ids = tok.encode(text, add_special_tokens=False).ids
            decoded = tok.decode(ids, skip_special_tokens=False)
            case = {"text": text, "ids": ids}
            if decoded != text:  # NFC changes decomposed text
                case["decoded"] = decoded
            cases.append(case)
        os.makedirs(os.path.join(OUT, kind), exist_ok=True)
        for name, obj in [("tokenizer.json", spec), ("expected.json", cases)]:
            path = os.path.join(OUT, kind, name)
            with open(path, "w", encoding="utf-8") as f:
                json.dump(obj, f, ensure_ascii=False, separators=(",", ":"))
                f.write("\n")
            total += os.path.getsize(path)
            print(f"{path}: {os.path.getsize(path)} bytes")
    # gpt2 with ByteLevel add_prefix_space=true (the test flips the flag in the same file): the
    # space is prepended to each piece between added tokens.
    spec = json.load(open(os.path.join(OUT, "gpt2", "tokenizer.json"), encoding="utf-8"))
    spec["pre_tokenizer"]["add_prefix_space"] = True
    tok = Tokenizer.from_str(json.dumps(spec))
    cases = [{"text": t, "ids": tok.encode(t, add_special_tokens=False).ids}
             for t in ["a<|endoftext|>b", "In the", " In", "", "<|endoftext|> x", TORTURE[0]]]
    path = os.path.join(OUT, "gpt2", "expected_add_prefix_space.json")
    with open(path, "w", encoding="utf-8") as f:
        json.dump(cases, f, ensure_ascii=False, separators=(",", ":"))
        f.write("\n")
    total += os.path.getsize(path)
    print(f"total {total} bytes")


if __name__ == "__main__":
    main()
