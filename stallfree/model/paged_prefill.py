"""Prefill attention over the paged KV cache (csrc/paged_prefill.cpp) and whether a batch
can use it.

Every prefill chunk of a batch in one call, reading its context in place through its block
table and skipping the keys its causal mask hides. Over a bfloat16 cache its products run in
AMX tiles where the CPU has AMX, else in AVX512_BF16 vectors (which it then needs); over a
float32 cache, in float vectors of the build's width, on any CPU the kernels build for. It
needs head_dim % 32 == 0 and block_size % 16 == 0; elsewhere (other dtypes and shapes, or
no kernels) attention.py runs the chunks in SDPA, which stays the reference. An int8 cache
(rows of head_dim int8 values and their float32 scale, [2, blocks, bs, Hkv, head_dim + 4])
takes the float32 path, each step's rows dequantized as they are read (csrc/paged_int8.h),
under a float32 or bfloat16 query (widened to float32, the output rounded back). The kernel
table's prefill_attention says which (kernel_table.py). Every path takes a sliding window
(its items start at the first key their queries see) and soft-capped scores.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import kernels, kv_quant
from .kernels import bf16_vectors_unavailable_reason

if TYPE_CHECKING:
    from .kernel_table import KernelTable


def usable(kv_cache: torch.Tensor, table: KernelTable) -> bool:
    """Whether prefill chunks over this layer's cache [2, blocks, block_size, Hkv, D] run in
    the kernel."""
    return (table.prefill_attention.kernel and kv_cache.device.type == "cpu"
            and kv_cache.dtype in DTYPES and kv_quant.head_dim(kv_cache) % 32 == 0
            and kv_cache.shape[2] % 16 == 0 and unavailable_reason(kv_cache.dtype) is None)


DTYPES = (torch.bfloat16, torch.float32, torch.int8)


def unavailable_reason(dtype: torch.dtype = torch.bfloat16) -> str | None:
    """Why the kernel cannot run over a cache of `dtype` on this CPU (None: it can); shapes
    aside."""
    if dtype not in DTYPES:
        return f"no path for a {dtype} cache"
    if dtype in (torch.float32, torch.int8):  # the float32 path: any build
        reason = kernels.unavailable_reason()
        return None if reason is None else f"kernels not built: {reason}"
    return bf16_vectors_unavailable_reason()


def paged_prefill(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                  query_lens: torch.Tensor, context_lens: torch.Tensor,
                  scale: float, tiles: bool = True, window: int | None = None,
                  softcap: float | None = None) -> torch.Tensor:
    """Chunk i's query_lens[i] rows of q [T, Hq, D] (in chunk order) against its first
    context_lens[i] keys through block_tables[i] [chunks, max_blocks] (int64), causally: its
    queries are the last query_lens[i] of those positions; q and the cache share a dtype
    (bfloat16 or float32), or the cache is int8 ([..., Hkv, D + 4]: each row's values, then
    its scale) under a float32 or bfloat16 q. Returns [T, Hq, D] in q's dtype.
    `tiles`: the products in AMX tiles where the CPU has them.
    `window`: a query at position p sees only keys (p - window, p] (None: all before it).
    `softcap`: scores s become softcap * tanh(s / softcap) (None: off)."""
    return torch.ops.stallfree.paged_prefill(q, kv_cache, block_tables, query_lens,
                                             context_lens, scale, tiles, window or 0,
                                             softcap or 0.0)
