"""The engine's paged attention for one layer: prefill chunks by cached tokens, decode
batches by context."""
from __future__ import annotations

import itertools
from collections.abc import Callable
from functools import partial
from typing import Any

import torch

from ..model import paged_decode
from ..model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from ..model.kernel_table import default_kernels
from ..sim.profile_csv import stat_columns, time_stats
from .timing import cpu_ms_interleaved

MIN_CONTEXT, MAX_CONTEXT = 16, 2048
COLD_BYTES = 128 << 20  # KV read between two calls of one case: more than the CPU caches
BLOCK = 16
# Small cases get more calls (a decode at 32 tokens of context takes ~50 us, and five calls
# left its median three times its least): about as many as CALLS_TOKENS KV tokens read.
CALLS_TOKENS = 4096
# What decodes run in, as the cost model reads it (sim/profile_store.py): the kernel reads
# each request's blocks in place, so a batch costs by its mean context; the torch path
# gathers length groups padded to each group's longest.
IN_PLACE, GATHER = "stallfree.paged_decode", "stallfree.paged_attention"


def profile_attention(cfg: Any, grid: dict[str, Any], dev: torch.device,
                      dt: torch.dtype) -> list[dict[str, Any]]:
    """The engine's paged_attention for one layer: prefill (chunk, cached), decode (batch, ctx)."""
    cases = [(1, c, k) for c in grid["chunks"] for k in grid["cached"] if c + k <= 4096]
    cases += [(b, 0, ctx) for b in grid["batches"]
              for ctx in sorted({n // b for n in grid["decode_tokens"]})
              if MIN_CONTEXT <= ctx <= MAX_CONTEXT]
    # One KV cache for every case, allocated once like the engine's.
    layers = cfg.num_hidden_layers
    size = torch.tensor([], dtype=dt).element_size()
    blocks = max(b * _blocks(c, k) * _copies(b * _blocks(c, k), cfg, layers, size)
                 for b, c, k in cases)
    cache = torch.zeros(2, blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=dt,
                        device=dev)
    backend = IN_PLACE if paged_decode.usable(cache, default_kernels()) else GATHER
    workspace = GatherWorkspace()  # one for every case, as the engine's layers share one
    calls = {(b, c, k): (partial(_attention_call, cfg, b, c, k, cache, layers, size, workspace),
                         grid["repeats"] * max(1, CALLS_TOKENS // (b * (c + k))))
             for b, c, k in cases}
    # Warm-up calls grow the gather workspace and settle the CPU caches, as in a running engine.
    stats = cpu_ms_interleaved(calls, warmup=3)
    return [_row(cfg, *case, stats[case], size, dev, backend) for case in cases]


def _blocks(chunk: int, cached: int) -> int:
    """KV blocks of one request: its cached tokens plus this chunk (one token for a decode)."""
    return -(-(cached + max(chunk, 1)) // BLOCK)


def _copies(blocks: int, cfg: Any, layers: int, itemsize: int) -> int:
    """How many disjoint copies of a case's KV to rotate through so each call reads it cold.

    The engine reads a different layer's KV for each of its `layers` calls an iteration, so
    its KV comes from memory, not the caches; reading one copy again and again would be too
    fast by up to a quarter at the contexts a light load reaches (8 MB of KV a layer).
    """
    nbytes = 2 * blocks * BLOCK * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return max(1, min(layers, -(-COLD_BYTES // nbytes)))


def _attention_call(cfg: Any, batch: int, chunk: int, cached: int, cache: torch.Tensor,
                    layers: int, itemsize: int, workspace: GatherWorkspace
                    ) -> Callable[[], Any]:
    """The call of one prefill chunk (chunk > 0) after `cached` tokens, or of `batch` decodes
    at that context, its metadata built."""
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev, dt = cache.device, cache.dtype
    prefill = chunk > 0
    per_seq = _blocks(chunk, cached)
    case = batch * per_seq
    built = [AttentionMetadata.build(
        [(cached if prefill else cached - 1, chunk if prefill else 1,
          list(range(j * case + i * per_seq, j * case + (i + 1) * per_seq)))
         for i in range(batch)], BLOCK, dev, workspace)
        for j in range(_copies(case, cfg, layers, itemsize))]
    for meta in built:  # once per iteration in the engine, not per layer: not timed
        meta.prepare(cache)
    metas = itertools.cycle(built)
    n = chunk if prefill else batch
    q = torch.randn(n, hq, hd, dtype=dt, device=dev)
    k, v = (torch.randn(n, hkv, hd, dtype=dt, device=dev) for _ in range(2))
    return lambda: paged_attention(q, k, v, cache, next(metas), hd ** -0.5)


def _row(cfg: Any, batch: int, chunk: int, cached: int, stats: dict[str, float],
         itemsize: int, dev: torch.device, backend: str) -> dict[str, Any]:
    """A case's row: its time under attn_prefill (chunk > 0) or attn_decode, the other blank."""
    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    zero = time_stats([0.0])
    timed, blank = ("attn_prefill", "attn_decode") if chunk > 0 else ("attn_decode",
                                                                      "attn_prefill")
    row = stat_columns("attn_input_reshape", zero) | stat_columns("attn_output_reshape", zero)
    return row | stat_columns(timed, stats) | {key: "" for key in stat_columns(blank, zero)} | {
        "n_embd": hq * hd, "n_q_head": hq, "n_kv_head": hkv, "block_size": BLOCK,
        "num_tensor_parallel_workers": 1, "max_model_len": 4096, "batch_size": batch,
        "prefill_chunk_size": chunk, "kv_cache_size": cached, "is_prefill": chunk > 0,
        "attention_backend": backend, "profile_method": "cpu",
        # The kernel caps its calls by KV bytes on CPU only (0: not capped).
        "kv_dtype_bytes": itemsize if dev.type == "cpu" else 0}
