#!/usr/bin/env python3
"""PyTorch FSDP2 baseline for the throughput tables of docs/benchmarks.md: the q3moe-8l geometry built with Hugging
Face transformers (Qwen3MoeForCausalLM), fully_shard with bf16 compute and fp32 master weights,
fused AdamW, on uniformly random tokens over the whole vocabulary, 32,768 tokens per optimizer step
(micro-batches of one sequence, gradient accumulation), as mop's benchmark runs.

  python3 scripts/fsdp2_baseline.py --seq 4096 [--checkpointing] [--steps 8]

Prints one line per step and, at the end, the mean tokens/s of the steps after the first two.
Needs torch and transformers (the H200 machine has both); one GPU, world size 1."""
import argparse
import os
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=4096)
    ap.add_argument("--tokens-per-step", type=int, default=32768)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing per layer")
    a = ap.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29511")
    dist.init_process_group("nccl", rank=0, world_size=1)
    torch.cuda.set_device(0)
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(vocab_size=151936, hidden_size=2048, num_hidden_layers=a.layers,
                         num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                         intermediate_size=6144, moe_intermediate_size=768, num_experts=128,
                         num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
                         mlp_only_layers=[], rope_theta=1e6, tie_word_embeddings=False,
                         max_position_embeddings=max(a.seq, 4096), router_aux_loss_coef=0.001,
                         output_router_logits=True, attn_implementation="sdpa")
    with torch.device("cuda"):
        model = Qwen3MoeForCausalLM(cfg)
    if a.checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1, fused=True)
    params = sum(p.numel() for p in model.parameters())
    micro = a.tokens_per_step // a.seq
    print(f"FSDP2 q3moe-{a.layers}l: {params / 1e9:.2f}B parameters, seq {a.seq}, {micro} micro-batches,"
          f" checkpointing {a.checkpointing}", flush=True)
    gen = torch.Generator(device="cuda").manual_seed(1)
    rates = []
    for step in range(a.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(micro):
            ids = torch.randint(0, cfg.vocab_size, (1, a.seq), device="cuda", generator=gen)
            out = model(input_ids=ids, labels=ids)
            (out.loss / micro).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t0
        rates.append(a.tokens_per_step / dt)
        print(f"step {step + 1}: loss {out.loss.item():.4f} {dt * 1e3:.0f} ms {rates[-1]:,.0f} tokens/s "
              f"peak {torch.cuda.max_memory_allocated() / 2**30:.1f} GiB", flush=True)
    steady = rates[2:] or rates
    print(f"FSDP2 seq {a.seq}: {sum(steady) / len(steady):,.0f} tokens/s (mean of steps 3-{a.steps})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
