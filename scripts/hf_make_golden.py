#!/usr/bin/env python3
"""Writes tests/hf/golden/: two tiny Hugging Face models saved by transformers and transformers'
fp32 logits and loss on fixed tokens, so the [cpu][hf] tests check mop's import and CPU forward
without torch.

  qwen3_moe/  Qwen3MoeForCausalLM, fp32: 3 layers (layer 0 dense through mlp_only_layers),
              tied embeddings, norm_topk_prob false, head_dim 8 ≠ hidden/heads.
  mixtral/    MixtralForCausalLM, saved in bf16 (the reference runs in fp32 on those
              bf16-rounded weights): 2 layers, untied head.
  tokens.txt  two sequences (16 and 11 tokens), one per line.
  */expected.json, */logits.bin  mean next-token cross-entropy over both sequences and every
              position's logits (float32, [27, 64], sequences in order).

Weights are drawn wider than transformers' init (std 0.25, norm weights in [0.5, 1.5]) so the
logits and the routing are far from uniform; the script refuses a seed whose top-k routing has a
near tie (gap < kMinRouteGap), where fp32 rounding could pick a different expert.

Usage: python3 scripts/hf_make_golden.py [--out tests/hf/golden]   (needs torch, transformers)
"""
import argparse
import json
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

kVocab = 64
kMinRouteGap = 1e-3  # fp32 router probabilities differ by ~1e-7 between implementations
kTokens = [
    [3, 17, 42, 8, 63, 0, 25, 25, 11, 50, 7, 33, 2, 19, 44, 60],
    [61, 4, 4, 28, 39, 12, 9, 55, 1, 30, 47],
]


def rope(theta):
    """RoPE base as the installed transformers spells it (5.x: rope_parameters, 4.x: rope_theta)."""
    if int(transformers.__version__.split(".")[0]) >= 5:
        return {"rope_parameters": {"rope_type": "default", "rope_theta": theta}}
    return {"rope_theta": theta}


def randomize(model, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            if p.dim() == 1:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.25)


def route_gap(model, top_k):
    """Smallest gap between the k-th and (k+1)-th router probability over tokens and layers."""
    gaps = []

    def hook(module, args, out):
        probs = torch.softmax(out[0].float(), dim=-1)
        top = torch.topk(probs, top_k + 1, dim=-1).values
        gaps.append((top[:, top_k - 1] - top[:, top_k]).min().item())

    routers = [m for n, m in model.named_modules() if n.endswith("mlp.gate") or n.endswith("block_sparse_moe.gate")]
    handles = [r.register_forward_hook(hook) for r in routers]
    with torch.no_grad():
        for seq in kTokens:
            model(torch.tensor([seq]))
    for h in handles:
        h.remove()
    return min(gaps)


def reference(model_dir):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    logits, ce_sum, predicted = [], 0.0, 0
    with torch.no_grad():
        for seq in kTokens:
            ids = torch.tensor([seq])
            out = model(ids)
            lg = out.logits[0].double()
            ce = torch.nn.functional.cross_entropy(lg[:-1], ids[0, 1:], reduction="sum").item()
            ce_sum += ce
            predicted += len(seq) - 1
            logits.append(out.logits[0].float().numpy())
    return model, np.concatenate(logits), ce_sum, predicted


def make(out, name, model, top_k, save_dtype):
    path = os.path.join(out, name)
    shutil.rmtree(path, ignore_errors=True)
    model.to(save_dtype).save_pretrained(path)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(path, extra)):
            os.remove(os.path.join(path, extra))
    loaded, logits, ce_sum, predicted = reference(path)
    gap = route_gap(loaded, top_k)
    assert gap > kMinRouteGap, f"{name}: top-k routing gap {gap:.2e}; pick another seed"
    logits.astype("<f4").tofile(os.path.join(path, "logits.bin"))
    expected = {
        "loss": ce_sum / predicted,
        "ce_sum": ce_sum,
        "predicted": predicted,
        "tokens": int(logits.shape[0]),
        "vocab": int(logits.shape[1]),
        "logits": "logits.bin",
        "min_route_gap": gap,
        "generated_by": "scripts/hf_make_golden.py",
        "transformers": transformers.__version__,
        "torch": torch.__version__,
    }
    with open(os.path.join(path, "expected.json"), "w") as f:
        json.dump(expected, f, indent=2)
        f.write("\n")
    print(f"{name}: loss {expected['loss']:.8f}, logits {logits.shape}, |logits| max {np.abs(logits).max():.3f}, "
          f"route gap {gap:.2e}, files {sorted(os.listdir(path))}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "tests", "hf", "golden"))
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    torch.manual_seed(0)

    q = Qwen3MoeConfig(vocab_size=kVocab, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=8, moe_intermediate_size=8,
                       num_experts=4, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[0],
                       tie_word_embeddings=True, rms_norm_eps=1e-6, **rope(10000.0),
                       max_position_embeddings=128, eos_token_id=1)
    qm = Qwen3MoeForCausalLM(q)
    randomize(qm, 1)
    qm.tie_weights()
    make(args.out, "qwen3_moe", qm, 2, torch.float32)

    x = MixtralConfig(vocab_size=kVocab, hidden_size=16, intermediate_size=8, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                      rms_norm_eps=1e-5, max_position_embeddings=128, **rope(1e6))
    xm = MixtralForCausalLM(x)
    randomize(xm, 2)
    make(args.out, "mixtral", xm, 2, torch.bfloat16)

    with open(os.path.join(args.out, "tokens.txt"), "w") as f:
        for seq in kTokens:
            f.write(" ".join(map(str, seq)) + "\n")


if __name__ == "__main__":
    main()
