"""Decode attention of one engine iteration (all layers), in the variants the kernel went through.

Run: OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/decode_attention.py [--quick]

Variants, measured side by side on the same batches (default model's shapes, fp32, a 1 GiB
KV cache with requests' blocks scattered through it):
  fresh      one call padded to the longest context, each gather a new tensor
  buffer     the same into the reused gather buffer
  groups     + length groups (padding at most 2x)
  shipped    + calls capped at MAX_CALL_BYTES of KV (stallfree/attention_plan.py)
Prints the median CPU milliseconds per iteration and each variant's speed-up over the one
before it.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time
from contextlib import contextmanager

import torch

import stallfree.attention_plan as plan
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.loader import default_model_path, load_model_config

BLOCK = 16
# (decodes, long requests among them, their context): the rest are short (mean ~270 tokens).
MIXED = [(12, 2, 900), (46, 3, 1015), (64, 4, 1500)]
UNIFORM = [(16, 1024), (32, 1024), (64, 1024), (32, 512)]


@contextmanager
def rule(padding_factor: float, call_bytes: int):
    saved = plan.MAX_PADDING_FACTOR, plan.MAX_CALL_BYTES
    plan.MAX_PADDING_FACTOR, plan.MAX_CALL_BYTES = padding_factor, call_bytes
    try:
        yield
    finally:
        plan.MAX_PADDING_FACTOR, plan.MAX_CALL_BYTES = saved


def iteration_ms(lens: list[int], cache: torch.Tensor, heads: tuple[int, int, int],
                 fresh: bool, repeats: int, rng: random.Random) -> float:
    """Median CPU ms of every layer's decode attention for contexts `lens`."""
    layers, num_blocks = cache.shape[0], cache.shape[2]
    hq, hkv, hd = heads
    seqs = [(c - 1, 1, [rng.randrange(num_blocks) for _ in range(-(-c // BLOCK))]) for c in lens]
    meta = AttentionMetadata.build(seqs, BLOCK, "cpu", GatherWorkspace())
    q, k = torch.randn(len(lens), hq, hd), torch.randn(len(lens), hkv, hd)

    def run() -> None:
        for i in range(layers):
            if fresh:  # a new destination per gather, as before the reused buffer
                meta.workspace = GatherWorkspace()
            paged_attention(q, k, k, cache[i], meta, hd ** -0.5)

    run()
    times = []
    for _ in range(repeats):
        start = time.process_time()
        run()
        times.append(time.process_time() - start)
    return statistics.median(times) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="two batches, three repeats")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cfg = load_model_config(default_model_path())
    heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim)
    per_block = 2 * cfg.num_hidden_layers * BLOCK * cfg.num_key_value_heads * cfg.head_dim * 4
    cache = torch.zeros(cfg.num_hidden_layers, 2, (1 << 30) // per_block, BLOCK,
                        cfg.num_key_value_heads, cfg.head_dim)
    rng = random.Random(0)
    batches = [[long_ctx - rng.randrange(60) for _ in range(n_long)]
               + [int(rng.expovariate(1 / 250)) + 20 for _ in range(n - n_long)]
               for n, n_long, long_ctx in MIXED]
    batches += [[ctx] * n for n, ctx in UNIFORM]
    if args.quick:
        batches = batches[:1] + batches[-1:]
    repeats = 3 if args.quick else 7
    variants = [("fresh", 1e9, 1 << 62, True), ("buffer", 1e9, 1 << 62, False),
                ("groups", 2, 1 << 62, False), ("shipped", 2, plan.MAX_CALL_BYTES, False)]
    print(f"{cfg.num_hidden_layers} layers, {heads[1]} KV heads x {heads[2]}, fp32; "
          f"median CPU ms per iteration ({repeats} repeats)")
    print("| decodes | longest | mean | " + " | ".join(v[0] for v in variants) + " | "
          + " | ".join(f"{b[0]} gain" for b in variants[1:]) + " |")
    print("|---" * (3 + 2 * len(variants) - 1) + "|")
    for lens in batches:
        ms = []
        for _, factor, cap, fresh in variants:
            with rule(factor, cap):
                ms.append(iteration_ms(lens, cache, heads, fresh, repeats, rng))
        gains = [f"{a / b:.2f}x" for a, b in zip(ms, ms[1:])]
        print(f"| {len(lens)} | {max(lens)} | {sum(lens) / len(lens):.0f} | "
              + " | ".join(f"{m:.0f}" for m in ms) + " | " + " | ".join(gains) + " |",
              flush=True)


if __name__ == "__main__":
    main()
