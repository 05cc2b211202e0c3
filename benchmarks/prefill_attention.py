"""Prefill attention of one chunk over all layers: the kernel that reads the paged cache
in place (csrc/paged_prefill.cpp) beside the torch path it replaces (the chunk's context
gathered, then SDPA with its causal mask; without a cached prefix SDPA's own causal path).
Over a bf16 cache its products run in AMX tiles on a CPU with AMX, elsewhere in AVX512_BF16
vectors (the first line printed says which); over a float32 cache (--dtype float32), in
float vectors of the build's width.

Run: .venv/bin/python benchmarks/prefill_attention.py [--rounds 5] [--layers 30]
     [--dtype float32]

Default model's shapes (9 query heads, 3 KV heads x 64, block size 16), a cache of
random values per layer with the chunk's blocks scattered through it (read cold, as an
engine's layers read theirs). Chunks of 128, 512 and 2048 new tokens after 0 to 1,536
cached ones. The two paths run in turn within every round (interleaved, so a load change
hits them alike); prints the median milliseconds per layer (wall time, all threads) and the
CPU's flags.
"""
from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

from stallfree.executor.hardware import vector_flags
from stallfree.model import paged_prefill
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.kernel_table import choose_kernels, default_kernels
from stallfree.model.kernels import amx_unavailable_reason
from stallfree.model.loader import default_model_path, load_model_config

BLOCK = 16
CHUNKS = [(0, 128), (1920, 128), (0, 512), (512, 512), (1536, 512), (0, 2048)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    dtype = getattr(torch, args.dtype)
    reason = paged_prefill.unavailable_reason(dtype)
    if reason is not None:
        raise SystemExit(f"the prefill kernel cannot run here: {reason}")
    cfg = load_model_config(default_model_path())
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    most = max(c + n for c, n in CHUNKS)
    num_blocks = 4 * most // BLOCK
    torch.manual_seed(0)
    caches = [torch.randn(2, num_blocks, BLOCK, hkv, hd).to(dtype) for _ in range(args.layers)]
    flags = vector_flags()
    path = ("float32 vectors" if dtype == torch.float32
            else "bf16 vectors" if amx_unavailable_reason() else "AMX tiles")
    print(f"{torch.get_num_threads()} threads, kernel in {path}; CPU flags: {flags}")
    print(f"{args.layers} layers, {args.dtype} cache of {num_blocks} blocks each; median ms per "
          f"layer of {args.rounds} interleaved rounds")
    print("| cached | new | SDPA path | kernel | speed-up |\n|---:|---:|---:|---:|---:|")
    rng = random.Random(0)
    tables = {True: default_kernels(), False: choose_kernels({"prefill_attention": "torch"})}
    for cached, new in CHUNKS:
        table = rng.sample(range(num_blocks), -(-(cached + new) // BLOCK))
        q = torch.randn(new, hq, hd).to(dtype)
        k, v = (torch.randn(new, hkv, hd).to(dtype) for _ in range(2))
        times: dict[bool, list[float]] = {True: [], False: []}
        for round_ in range(args.rounds + 1):  # the first round warms up
            for kernel in (False, True):
                # Built and prepared once per forward in the engine, not per layer: untimed.
                meta = AttentionMetadata.build([(cached, new, table)], BLOCK, "cpu",
                                               GatherWorkspace(), kernels=tables[kernel])
                meta.prepare(caches[0])
                start = time.perf_counter()
                for cache in caches:
                    paged_attention(q, k, v, cache, meta, hd ** -0.5)
                seconds = (time.perf_counter() - start) / args.layers
                if round_:
                    times[kernel].append(seconds)
        sdpa, kern = (statistics.median(times[x]) * 1e3 for x in (False, True))
        print(f"| {cached} | {new} | {sdpa:.3f} | {kern:.3f} | {sdpa / kern:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
