#!/usr/bin/env python3
"""Builds a Hugging Face tokenizer.json of the Qwen2/Qwen3 form from Qwen's BPE ranks file
(qwen.tiktoken: 151,643 byte sequences by merge rank, as the `dashscope` PyPI wheel ships it under
dashscope/resources/), for testing mop's tokenizer on Qwen's real vocabulary where the published
tokenizer.json cannot be downloaded:

  vocabulary   each rank's bytes in the byte-level alphabet (GPT-2's bytes → unicode map), id = rank
  merges       for every token of two or more bytes, the pair that byte-level BPE restricted to the
               lower ranks leaves (its merge priority is its rank)
  around it    NFC, Qwen's split regex (isolated) + ByteLevel without its regex, the ByteLevel
               decoder and post-processor, and <|endoftext|> <|im_start|> <|im_end|> at 151643–5

With --check TEXT, also encodes TEXT with tiktoken (pip install tiktoken) on the ranks file and with
the `tokenizers` package on the result and reports whether every id agrees.

Usage: python3 scripts/qwen_tokenizer_from_tiktoken.py --ranks qwen.tiktoken --out tokenizer.json [--check data/kjv.txt]
"""
import argparse
import base64
import json
import os
import sys

QWEN_REGEX = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
              r"\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def byte_alphabet():
    """GPT-2's reversible map of the 256 bytes to printable characters."""
    keep = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, n = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + n)
            n += 1
    return chars


def read_ranks(path):
    ranks = {}
    with open(path, "rb") as f:
        for line in f:
            if line.strip():
                token, rank = line.split()
                ranks[base64.b64decode(token)] = int(rank)
    return ranks


def split_pair(token, ranks):
    """The two parts BPE leaves of `token` merging only pairs ranked below it."""
    limit = ranks[token]
    parts = [bytes([b]) for b in token]
    while len(parts) > 2:
        best, at = None, -1
        for i in range(len(parts) - 1):
            r = ranks.get(parts[i] + parts[i + 1])
            if r is not None and r < limit and (best is None or r < best):
                best, at = r, i
        if best is None:
            break
        parts[at:at + 2] = [parts[at] + parts[at + 1]]
    if len(parts) != 2:
        raise SystemExit(f"rank {limit}: {token!r} does not split into two lower-ranked tokens")
    return parts


def build(ranks):
    alpha = byte_alphabet()
    spell = lambda b: "".join(alpha[x] for x in b)  # noqa: E731
    vocab = {spell(t): r for t, r in ranks.items()}
    merges = []
    for t, r in sorted(ranks.items(), key=lambda kv: kv[1]):
        if len(t) > 1:
            a, b = split_pair(t, ranks)
            merges.append(f"{spell(a)} {spell(b)}")
    first = len(ranks)
    added = [{"id": first + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, s in enumerate(SPECIALS)]
    return {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": QWEN_REGEX}, "behavior": "Isolated", "invert": False},
            {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]},
        "post_processor": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "decoder": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }


def check(ranks, out, path):
    import tiktoken
    import tokenizers
    enc = tiktoken.Encoding("qwen", pat_str=QWEN_REGEX, mergeable_ranks=ranks, special_tokens={})
    tok = tokenizers.Tokenizer.from_file(out)
    with open(path, encoding="utf-8") as f:
        docs = [d for d in f.read().split("\n\n") if d.strip()]
    bad = sum(enc.encode_ordinary(d) != tok.encode(d, add_special_tokens=False).ids for d in docs)
    print(f"check: {len(docs)} documents of {path}: {len(docs) - bad} encode to the same ids with tiktoken and tokenizers")
    return bad == 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ranks", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--check", help="a text file (documents split at blank lines)")
    a = ap.parse_args()
    ranks = read_ranks(a.ranks)
    spec = build(ranks)
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)  # e.g. runs/qwen-vocab/ of the docs
    with open(a.out, "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False)
    print(f"wrote {a.out}: {len(spec['model']['vocab'])} tokens, {len(spec['model']['merges'])} merges, "
          f"{len(SPECIALS)} added tokens")
    if a.check and not check(ranks, a.out, a.check):
        sys.exit(1)


if __name__ == "__main__":
    main()
