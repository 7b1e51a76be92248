#!/usr/bin/env python3
"""Writes a small Hugging Face Qwen3-MoE model directory with its own tokenizer, for docs/hugging-face.md's
end-to-end example (import-hf → prepare-data with the model's tokenizer → train → generate →
export-hf) where the real Qwen3 files cannot be downloaded:

  config.json             Qwen3MoeForCausalLM (q/k norm, norm_topk_prob), the sizes given
  model.safetensors       fp32 weights drawn as transformers initialises them (std 0.02, norms 1)
  tokenizer.json          --tokenizer's (e.g. Qwen's vocabulary from
                          scripts/qwen_tokenizer_from_tiktoken.py), or a Qwen2/Qwen3-form
                          byte-level BPE (NFC, Qwen's split regex, the <|endoftext|>,
                          <|im_start|>, <|im_end|> specials) trained on --text
  tokenizer_config.json   what transformers' AutoTokenizer reads beside it

Needs numpy and tokenizers (pip install numpy tokenizers); not torch or transformers. With a real
model, `huggingface-cli download Qwen/Qwen3-30B-A3B` gives the same files and the same commands run.

Usage: python3 scripts/make_tiny_qwen3_moe.py --text data/kjv.txt --out runs/tiny-qwen3
       python3 scripts/make_tiny_qwen3_moe.py --tokenizer qwen/tokenizer.json --vocab-size 151936 --out runs/tiny-qwen3
"""
import argparse
import json
import os
import struct
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import make_tokenizer_fixtures as fixtures  # noqa: E402  (the Qwen2-form tokenizer builder)


def write_safetensors(path, tensors):
    """tensors: name → float32 array; the safetensors layout (header length, JSON header, data)."""
    header, offset, blobs = {}, 0, []
    for name in sorted(tensors):
        a = np.ascontiguousarray(tensors[name], dtype=np.float32)
        header[name] = {"dtype": "F32", "shape": list(a.shape), "data_offsets": [offset, offset + a.nbytes]}
        blobs.append(a.tobytes())
        offset += a.nbytes
    header["__metadata__"] = {"format": "pt"}
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for b in blobs:
            f.write(b)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--text", help="UTF-8 text a tokenizer is trained on (without --tokenizer)")
    ap.add_argument("--tokenizer", help="a tokenizer.json to use instead of training one")
    ap.add_argument("--out", required=True)
    ap.add_argument("--vocab", type=int, default=4096, help="the trained tokenizer's size")
    ap.add_argument("--vocab-size", type=int, default=0,
                    help="the model's vocabulary (embedding rows; Qwen3 pads 151,669 ids to 151,936); default: the tokenizer's")
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--expert-ffn", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    os.makedirs(a.out, exist_ok=True)

    if a.tokenizer:
        with open(a.tokenizer, encoding="utf-8") as f:
            spec = json.load(f)
        tok = fixtures.Tokenizer.from_str(json.dumps(spec))
    else:
        if not a.text:
            ap.error("give --text (to train a tokenizer) or --tokenizer")
        with open(a.text, encoding="utf-8") as f:
            text = f.read()
        tok, spec = fixtures.build("qwen2", vocab_size=a.vocab, texts=[text])
    with open(os.path.join(a.out, "tokenizer.json"), "w", encoding="utf-8") as f:
        json.dump(spec, f, ensure_ascii=False, indent=2)
    eos = tok.token_to_id("<|endoftext|>")
    with open(os.path.join(a.out, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "Qwen2Tokenizer", "eos_token": "<|endoftext|>",
                   "pad_token": "<|endoftext|>", "unk_token": None, "bos_token": None,
                   "model_max_length": 32768, "clean_up_tokenization_spaces": False}, f, indent=2)

    vocab = max(tok.get_vocab_size(), a.vocab_size)
    head_dim = a.hidden // a.heads
    config = {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab, "hidden_size": a.hidden, "num_hidden_layers": a.layers,
        "num_attention_heads": a.heads, "num_key_value_heads": a.kv_heads, "head_dim": head_dim,
        "num_experts": a.experts, "num_experts_per_tok": a.top_k, "moe_intermediate_size": a.expert_ffn,
        "intermediate_size": a.expert_ffn * a.top_k, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "norm_topk_prob": True, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0,
        "max_position_embeddings": 32768, "tie_word_embeddings": False, "hidden_act": "silu",
        "attention_bias": False, "attention_dropout": 0.0, "router_aux_loss_coef": 0.001,
        "output_router_logits": False, "use_cache": True, "use_sliding_window": False,
        "sliding_window": None, "initializer_range": 0.02, "bos_token_id": None,
        "eos_token_id": eos, "torch_dtype": "float32",
    }
    with open(os.path.join(a.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)

    rng = np.random.default_rng(a.seed)
    normal = lambda *shape: rng.normal(0.0, 0.02, shape).astype(np.float32)  # noqa: E731
    H, F, E = a.hidden, a.expert_ffn, a.experts
    t = {"model.embed_tokens.weight": normal(vocab, H), "model.norm.weight": np.ones(H, np.float32),
         "lm_head.weight": normal(vocab, H)}
    for l in range(a.layers):
        p = f"model.layers.{l}."
        t[p + "input_layernorm.weight"] = np.ones(H, np.float32)
        t[p + "post_attention_layernorm.weight"] = np.ones(H, np.float32)
        t[p + "self_attn.q_proj.weight"] = normal(a.heads * head_dim, H)
        t[p + "self_attn.k_proj.weight"] = normal(a.kv_heads * head_dim, H)
        t[p + "self_attn.v_proj.weight"] = normal(a.kv_heads * head_dim, H)
        t[p + "self_attn.o_proj.weight"] = normal(H, a.heads * head_dim)
        t[p + "self_attn.q_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "self_attn.k_norm.weight"] = np.ones(head_dim, np.float32)
        t[p + "mlp.gate.weight"] = normal(E, H)
        for e in range(E):
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = normal(F, H)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = normal(F, H)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = normal(H, F)
    write_safetensors(os.path.join(a.out, "model.safetensors"), t)
    n = sum(v.size for v in t.values())
    print(f"wrote {a.out}: Qwen3MoeForCausalLM, {n / 1e6:.2f}M parameters, vocabulary {vocab}, tokenizer of "
          f"{tok.get_vocab_size()} ids "
          f"(eos <|endoftext|> = {eos})")


if __name__ == "__main__":
    main()
