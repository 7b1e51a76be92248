#!/usr/bin/env python3
"""Writes the fuzz targets' seed corpus, fuzz/corpus/<target>/: small valid inputs and near-valid
ones (one field wrong), a few KB per target, so libFuzzer starts from the formats' structure
instead of random bytes; and their dictionaries, fuzz/<target>.dict (keywords, the config's keys
from src/config/config_schema.cpp, boundary numbers), which scripts/fuzz.sh passes as -dict. Standard library only; rerun when a format changes and commit the result.
The fixtures it copies are the tests' (tests/ckpt/fixtures, tests/data/fixtures, configs/)."""
import json
import os
import re
import shutil
import struct

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


def copy(target, name, *path):
    with open(os.path.join(ROOT, *path), "rb") as f:
        write(target, name, f.read())


def compact(value):
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def json_seeds():
    write("json", "object", '{"a": [1, -2, 3.5e-3, true, false, null], "b": {"c": "d"}, "e": []}')
    write("json", "numbers", "[0, -0, 9223372036854775807, -9223372036854775808, "
          "18446744073709551615, 1.7976931348623157e308, 5e-324, 1E+2, 0.1]")
    write("json", "strings", r'["\"\\\/\b\f\n\r\t", "\u00e9\ud83d\ude00", "é日本🙂", ""]')
    write("json", "long_key", compact({"k" * 300: {"nested": [[[[{}]]]]}}))
    write("json", "near_trailing_comma", '{"a": 1, "b": [1, 2,],}')
    write("json", "near_duplicate_key", '{"a": 1, "a": 2}')
    write("json", "near_lone_surrogate", '["\\ud800", 01, .5, 1e]')


def safetensors_file(tensors, metadata=None):
    """tensors: [(name, dtype, shape, raw bytes)], laid out in order."""
    header, data = {}, b""
    if metadata is not None:
        header["__metadata__"] = metadata
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = compact(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def safetensors_seeds():
    copy("safetensors", "reference", "tests", "ckpt", "fixtures", "reference.safetensors")
    f32 = struct.pack("<4f", 1, 2, 3, 4)
    write("safetensors", "small", safetensors_file(
        [("w", "F32", [2, 2], f32), ("b", "BF16", [3], b"\x80\x3f" * 3),
         ("step", "I64", [], struct.pack("<q", 7)), ("empty", "U8", [0, 5], b"")],
        {"format": "pt"}))
    write("safetensors", "near_bad_offsets", safetensors_file([("w", "F32", [2, 2], f32)])
          .replace(b'"data_offsets":[0,16]', b'"data_offsets":[0,17]'))
    write("safetensors", "near_unsupported_dtype", safetensors_file([("h", "F16", [2], b"\0" * 4)]))
    write("safetensors", "near_truncated", safetensors_file([("w", "F32", [2, 2], f32)])[:-3])


def manifest_seeds():
    m = {"format_version": 1, "step": 40, "mop_version": "0.1.0",
         "config": "model:\n  vocab_size: 257\n",
         "state": {"data": {"cursor": 1234, "epoch": 0}, "rng": [1, 2, 3]},
         "files": [{"name": "model.safetensors", "bytes": 781, "sha256": "ab" * 32},
                   {"name": "optimizer.safetensors", "bytes": 0, "sha256": "0" * 64}]}
    write("manifest", "valid", json.dumps(m, indent=2))
    write("manifest", "no_files", compact(dict(m, files=[])))
    bad = dict(m, files=[{"name": "../escape", "bytes": 1, "sha256": "AB" * 32}])
    write("manifest", "near_bad_file", compact(bad))
    write("manifest", "near_future_format", compact(dict(m, format_version=2, step=-1)))


def tokenizer_seeds():
    copy("tokenizer", "sp_unk", "tests", "data", "fixtures", "tokenizer", "sp_unk", "tokenizer.json")
    added = lambda i, c, special=True, normalized=False, lstrip=False: {
        "id": i, "content": c, "single_word": False, "lstrip": lstrip, "rstrip": False,
        "normalized": normalized, "special": special}
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    gpt2 = {"version": "1.0", "truncation": None, "padding": None,
            "added_tokens": [added(0, "<|endoftext|>")], "normalizer": {"type": "NFC"},
            "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
                {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}| ?\\p{L}+|\\s+(?!\\S)|\\s+"},
                 "behavior": "Isolated", "invert": False},
                dict(byte_level, use_regex=False)]},
            "post_processor": {"type": "TemplateProcessing",
                               "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                                          {"Sequence": {"id": "A", "type_id": 0}}],
                               "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [0],
                                                                   "tokens": ["<|endoftext|>"]}}},
            "decoder": byte_level,
            "model": {"type": "BPE", "dropout": None, "unk_token": None,
                      "continuing_subword_prefix": None, "end_of_word_suffix": None,
                      "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {"<|endoftext|>": 0, "H": 1, "e": 2, "l": 3, "o": 4, "Ġ": 5,
                                "w": 6, "He": 7, "ll": 8, "Hell": 9, "Hello": 10, "Ġw": 11},
                      "merges": ["H e", "l l", "He ll", "Hell o", "Ġ w"]}}
    write("tokenizer", "byte_level", compact(gpt2))
    meta = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    sp = {"version": "1.0", "truncation": None, "padding": None,
          "added_tokens": [added(0, "<unk>"), added(1, "<s>"), added(2, "</s>"),
                           added(9, "[X]", special=False, normalized=True, lstrip=True)],
          "normalizer": None, "pre_tokenizer": meta,
          "post_processor": {"type": "Sequence", "processors": [
              {"type": "ByteLevel"},
              {"type": "TemplateProcessing",
               "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                          {"Sequence": {"id": "A", "type_id": 0}},
                          {"SpecialToken": {"id": "</s>", "type_id": 0}}],
               "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]},
                                  "</s>": {"id": "</s>", "ids": [2], "tokens": ["</s>"]}}}]},
          "decoder": {"type": "Sequence", "decoders": [
              meta, {"type": "ByteFallback"}, {"type": "Fuse"},
              {"type": "Strip", "content": " ", "start": 1, "stop": 1}]},
          "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "fuse_unk": True,
                    "byte_fallback": True, "ignore_merges": True,
                    "vocab": {"<unk>": 0, "<s>": 1, "</s>": 2, "▁": 3, "a": 4, "b": 5, "▁a": 6,
                              "<0xC3>": 7, "<0xA9>": 8},
                    "merges": [["▁", "a"]]}}
    write("tokenizer", "metaspace", compact(sp))
    near = dict(gpt2, model=dict(gpt2["model"], merges=["H e", "l o"]))
    write("tokenizer", "near_bad_merge", compact(near))
    near = dict(sp, pre_tokenizer={"type": "Split", "pattern": {"Regex": "(a+)+$"},
                                   "behavior": "Isolated", "invert": False})
    write("tokenizer", "near_split_alone", compact(near))


def config_seeds():
    for name in ("tiny", "growth-cpu", "tiny-qwen3"):
        copy("config", name, "configs", name + ".yaml")
    write("config", "flow", "model: {vocab_size: 512, hidden_size: 64, num_layers: 2, num_heads: 2}\n"
          "moe: {num_experts: 4, top_k: 1, expert_ffn: 32}\ndata: {paths: [a, b], seq_len: 64}\n")
    write("config", "near_typo", "model:\n  vocab_sise: 257\nmoe:\n  top_k: 9\n  num_experts: 4\n")
    write("config", "near_types", "train:\n  steps: -1\n  micro_batch_size: 1.5\nlog: [1, 2]\n"
          "optim:\n  lr: .nan\n")


def megatron_idx(dtype_code, lengths, itemsize, documents):
    """The target's input: u64 .bin size, then the .idx."""
    pointers, at = [], 0
    for n in lengths:
        pointers.append(at)
        at += n * itemsize
    idx = (b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, dtype_code, len(lengths), len(documents))
           + struct.pack(f"<{len(lengths)}i", *lengths) + struct.pack(f"<{len(lengths)}q", *pointers)
           + struct.pack(f"<{len(documents)}q", *documents))
    return struct.pack("<Q", at) + idx


def megatron_seeds():
    fixtures = os.path.join(ROOT, "tests", "data", "fixtures")
    for name in ("megatron_uint16", "megatron_int32"):
        with open(os.path.join(fixtures, name + ".idx"), "rb") as f:
            idx = f.read()
        bin_bytes = os.path.getsize(os.path.join(fixtures, name + ".bin"))
        write("megatron_idx", name, struct.pack("<Q", bin_bytes) + idx)
    write("megatron_idx", "uint8", megatron_idx(1, [3, 0, 5], 1, [0, 1, 3]))
    write("megatron_idx", "empty", megatron_idx(5, [], 8, [0]))
    near = bytearray(megatron_idx(8, [2, 2], 2, [0, 2]))
    near[8 + 34 + 8:8 + 34 + 16] = struct.pack("<q", 6)  # second pointer leaves a gap
    write("megatron_idx", "near_gap", bytes(near))
    write("megatron_idx", "near_multimodal", megatron_idx(4, [1, 1], 4, [0, 2]) + b"\0\0")


# Boundary numbers for the text formats: int32/int64/uint64 edges, 2^62, and out-of-range doubles.
NUMBERS = ["0", "-1", "1e300", "-1e300", "1e-400", "2147483647", "2147483648", "16777216",
           "4294967296", "4611686018427387904", "9223372036854775807", "9223372036854775808",
           "18446744073709551615", "18446744073709551616", "1e12", "1e18", ".nan", ".inf"]
JSON_TOKENS = ["{", "}", "[", "]", ":", ",", '"', "true", "false", "null", "\\u", "\\ud83d\\ude00",
               "\\u0000", "e+", "E-"]


def write_dict(target, comment, tokens):
    """fuzz/<target>.dict in libFuzzer's -dict format: one quoted token a line."""
    with open(os.path.join(ROOT, "fuzz", target + ".dict"), "w") as f:
        f.write(f"# libFuzzer dictionary for {target}_fuzz (fuzz/make_corpus.py): {comment}\n")
        seen = set()
        for t in tokens:
            b = t if isinstance(t, bytes) else t.encode()
            if b not in seen:
                seen.add(b)
                f.write('"' + "".join(chr(c) if 32 <= c < 127 and c not in b'"\\' else f"\\x{c:02X}"
                                      for c in b) + '"\n')


def dictionaries():
    write_dict("json", "grammar and boundary numbers", JSON_TOKENS + NUMBERS)
    write_dict("safetensors", "header fields, dtypes, boundary numbers", JSON_TOKENS + NUMBERS + [
        "__metadata__", "dtype", "shape", "data_offsets", "F32", "F64", "BF16", "I32", "I64", "U8",
        "U16", "U32", "F16", "BOOL", struct.pack("<Q", 8)])
    write_dict("manifest", "fields and boundary numbers", JSON_TOKENS + NUMBERS + [
        "format_version", "step", "mop_version", "config", "state", "files", "name", "bytes",
        "sha256", "manifest.json", "..", "/", "a" * 64])
    write_dict("tokenizer", "tokenizer.json's parts and boundary ids", JSON_TOKENS + NUMBERS + [
        "model", "type", "BPE", "vocab", "merges", "unk_token", "byte_fallback", "fuse_unk",
        "ignore_merges", "dropout", "continuing_subword_prefix", "end_of_word_suffix",
        "added_tokens", "id", "content", "special", "lstrip", "rstrip", "normalized", "single_word",
        "normalizer", "normalizers", "NFC", "Prepend", "prepend", "Replace", "pattern", "String",
        "Regex", "Sequence", "pre_tokenizer", "pretokenizers", "Split", "behavior", "Isolated",
        "invert", "ByteLevel", "add_prefix_space", "use_regex", "Metaspace", "replacement",
        "prepend_scheme", "first", "always", "never", "split", "decoder", "decoders",
        "ByteFallback", "Fuse", "Strip", "start", "stop", "post_processor", "processors",
        "TemplateProcessing", "single", "SpecialToken", "special_tokens", "ids", "A", "<0x41>",
        "<0xC3>", "\u2581", "\u0120", "(a+)+$", "\\p{L}+", "(?i:", "truncation", "padding"])
    # Every section and key name of the schema, and the string values it offers.
    with open(os.path.join(ROOT, "src", "config", "config_schema.cpp")) as f:
        schema = f.read()
    keys = sorted({k for path in re.findall(r's\.[a-z]\("([a-z_.]+)"', schema) for k in path.split(".")})
    choices = sorted(set(re.findall(r'"([a-z0-9_]+)"', schema)) - set(keys))
    write_dict("config", "the schema's sections, keys and choices, YAML syntax, boundary numbers",
               [k + ": " for k in keys] + choices + NUMBERS + [
                   "{", "}", "[", "]", "? ", "- ", "&a ", "*a", "!!str ", "experts", "tokens", "steps",
                   "true", "false", "null", "~", "'", '"'])
    write_dict("megatron_idx", "the header's magic, version, dtype codes and boundary counts", [
        b"MMIDIDX\x00\x00", struct.pack("<Q", 1), struct.pack("<i", 2**31 - 1),
        struct.pack("<q", 2**63 - 1), struct.pack("<i", -2**31), b"\x01", b"\x03", b"\x04", b"\x05",
        b"\x08"])


if __name__ == "__main__":
    shutil.rmtree(CORPUS, ignore_errors=True)
    for seeds in (json_seeds, safetensors_seeds, manifest_seeds, tokenizer_seeds, config_seeds,
                  megatron_seeds, dictionaries):
        seeds()
    for target in sorted(os.listdir(CORPUS)):
        files = os.listdir(os.path.join(CORPUS, target))
        size = sum(os.path.getsize(os.path.join(CORPUS, target, f)) for f in files)
        print(f"{target}: {len(files)} files, {size} bytes")
