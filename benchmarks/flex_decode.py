"""Decode attention through torch's flex_attention, reading the engine's paged KV cache in
place, beside the engine's own decode path on the same device: the candidate for a CUDA
decode path, where the engine gathers each request's blocks and runs SDPA.

Run: python benchmarks/flex_decode.py [--device cuda] [--dtype bfloat16] [--batches 1,8,32,64]
     [--context 512] [--blocks 8192] [--rounds 15]
Default model's shapes (9 query heads, 3 KV heads x 64, blocks of 16 tokens), one layer's
cache of random values, each request's blocks scattered through it. Per batch: flex's
largest error against a float32 reference (and the engine path's), its compile time, the
block mask's build time (once a step, shared by the layers), and the median microseconds
of one layer's call of each path with the KV bytes it reads per second.

How flex reads the cache: K and V of one layer are views of it as one sequence of
blocks x 16 keys; the block mask lists each request's blocks (kv_indices) from its block
table, and a mask_mod cuts its last block at its length. The query heads of a KV head are
folded into the query length (9/3 heads: 3 queries a KV head), since flex's decode kernel
wants a power-of-two GQA ratio, and the mask ignores the query index.

Reading CUDA's small batches (torch's source, not yet run): flex's decode kernel cuts each
request's list of blocks into parts of the whole key length (here the cache's) over the
number of parts the GPU's multiprocessors and the batch allow, so at a few requests a
512-token context falls into one part: one thread block per request and KV head does the
work, where the engine's gather + SDPA spreads it.
"""
from __future__ import annotations

import argparse
import random
import time
from functools import partial

import torch
import torch.nn.functional as F
from device_timing import device_name, median_seconds
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16


def block_mask(tables: torch.Tensor, lens: torch.Tensor, num_blocks: int,
               queries: int) -> BlockMask:
    """Each row's blocks [B, width] (padded) and context lengths [B] as a flex block mask
    over the cache's num_blocks * BLOCK keys."""
    rows = lens.shape[0]
    used = (lens + BLOCK - 1) // BLOCK
    # Inductor's CPU template wants the list as wide as the key blocks; CUDA does not.
    width = num_blocks if tables.device.type == "cpu" else tables.shape[1]
    indices = torch.zeros(rows, 1, 1, width, dtype=torch.int32, device=tables.device)
    indices[:, 0, 0, :tables.shape[1]] = tables.to(torch.int32)
    last = tables.gather(1, (used - 1).view(rows, 1)).view(rows)
    valid_in_last = lens - (used - 1) * BLOCK

    def mask_mod(b, h, q_idx, kv_idx):
        # Only listed blocks are visited; of them only the last is partly empty.
        return (kv_idx // BLOCK != last[b]) | (kv_idx % BLOCK < valid_in_last[b])

    return BlockMask.from_kv_blocks(used.to(torch.int32).view(rows, 1, 1), indices,
                                    BLOCK_SIZE=(128, BLOCK), mask_mod=mask_mod,
                                    seq_lengths=(queries, num_blocks * BLOCK),
                                    compute_q_blocks=False)


def flex_decode(attend, q: torch.Tensor, cache: torch.Tensor, mask: BlockMask,
                kernel_options: dict | None) -> torch.Tensor:
    """q [B, Hq, D] against one layer's cache [2, blocks, BLOCK, Hkv, D] -> [B, Hq, D]."""
    _, num_blocks, _, kv_heads, dim = cache.shape
    rows, heads, _ = q.shape
    k, v = (cache[i].view(1, num_blocks * BLOCK, kv_heads, dim).transpose(1, 2)
            for i in range(2))
    out = attend(q.view(rows, kv_heads, heads // kv_heads, dim), k, v, block_mask=mask,
                 scale=dim ** -0.5, kernel_options=kernel_options)
    return out.reshape(rows, heads, dim)


def reference(q: torch.Tensor, cache: torch.Tensor, seqs: list[tuple[int, int, list[int]]]
              ) -> torch.Tensor:
    """Each request's keys gathered by slot, attended in float32."""
    flat = cache.float().flatten(1, 2)  # [2, slots, Hkv, D]
    out = []
    for i, (start, _, table) in enumerate(seqs):
        pos = torch.arange(start + 1, device=cache.device)
        slots = torch.tensor(table, device=cache.device)[pos // BLOCK] * BLOCK + pos % BLOCK
        k, v = (flat[j, slots].transpose(0, 1)[None] for j in range(2))
        out.append(F.scaled_dot_product_attention(q[i:i + 1, :, None].float(), k, v,
                                                  enable_gqa=True)[0, :, 0])
    return torch.stack(out)


def compile_first_call(attend, q, cache, mask, options: dict | None
                       ) -> tuple[torch.Tensor, float, dict | None]:
    """flex's first call on this shape (it compiles): output, seconds, and the kernel
    options it took."""
    start = time.perf_counter()
    try:
        out = flex_decode(attend, q, cache, mask, options)
    except Exception as failure:  # noqa: BLE001 - a block of 16 keys may need a tile as narrow
        print(f"flex failed ({type(failure).__name__}: {str(failure)[:300]}); "
              f"again with BLOCK_N={BLOCK}")
        options = {"BLOCK_N": BLOCK}
        out = flex_decode(attend, q, cache, mask, options)
    return out, time.perf_counter() - start, options


def measure(batch: int, cache: torch.Tensor, attend, options: dict | None, args,
            rng: random.Random, gen: torch.Generator) -> dict | None:
    """Prints one batch's row; returns the kernel options flex took."""
    device, num_blocks = cache.device, cache.shape[1]
    blocks = rng.sample(range(num_blocks), batch * -(-args.context // BLOCK))
    per = len(blocks) // batch
    # Contexts a little under `context`, so that last blocks are partly empty.
    seqs = [(args.context - 1 - rng.randrange(BLOCK), 1, blocks[i * per:(i + 1) * per])
            for i in range(batch)]
    meta = AttentionMetadata.build(seqs, BLOCK, device, GatherWorkspace())
    q = torch.randn(batch, HEADS, HEAD_DIM, device=device, generator=gen).to(cache.dtype)
    tables, lens = meta.decode_block_tables, meta.decode_context_lens
    engine = partial(paged_attention, q, q[:, :KV_HEADS], q[:, :KV_HEADS], cache, meta,
                     HEAD_DIM ** -0.5, cache_written=True)
    make_mask = partial(block_mask, tables, lens, num_blocks, HEADS // KV_HEADS)
    mask = make_mask()
    out, compile_s, options = compile_first_call(attend, q, cache, mask, options)
    truth = reference(q, cache, seqs)
    errors = [((x.float() - truth).abs().max() / truth.abs().max()).item()
              for x in (out, engine())]
    mask_s = median_seconds(make_mask, args.rounds, device, calls=3)
    flex_s = median_seconds(partial(flex_decode, attend, q, cache, mask, options),
                            args.rounds, device)
    engine_s = median_seconds(engine, args.rounds, device)
    kv_bytes = 2 * int(lens.sum()) * KV_HEADS * HEAD_DIM * cache.dtype.itemsize
    print(f"| {batch} | {errors[0]:.1e} | {errors[1]:.1e} | {compile_s:.1f} | "
          f"{mask_s * 1e6:.0f} | {flex_s * 1e6:.0f} | {engine_s * 1e6:.0f} | "
          f"{kv_bytes / flex_s / 1e9:.1f} | {kv_bytes / engine_s / 1e9:.1f} |", flush=True)
    return options


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--batches", default="1,8,32,64")
    ap.add_argument("--context", type=int, default=512)
    ap.add_argument("--blocks", type=int, default=8192, help="blocks in the layer's cache")
    ap.add_argument("--rounds", type=int, default=15)
    args = ap.parse_args()
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = torch.randn(2, args.blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device,
                        generator=gen).to(dtype)
    attend = torch.compile(flex_attention, dynamic=False)  # one graph per batch size
    print(f"{device_name(device)}, {dtype}, {HEADS}/{KV_HEADS} heads x {HEAD_DIM}, contexts of "
          f"{args.context} tokens, {args.blocks} blocks of {BLOCK}")
    print("| decodes | flex error | engine error | compile s | mask us | flex us | engine us "
          "| flex GB/s | engine GB/s |\n|---|---|---|---|---|---|---|---|---|")
    rng, options = random.Random(0), None
    for batch in (int(b) for b in args.batches.split(",")):
        options = measure(batch, cache, attend, options, args, rng, gen)


if __name__ == "__main__":
    main()
