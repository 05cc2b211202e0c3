"""The CPU decode-attention kernel (csrc/paged_decode.cpp) and whether a call can use it.

Without the kernel library (see kernels.py), on a non-CPU device or another head size,
decode attention takes the torch path of attention.py, which stays the reference. On a CPU
with AMX and a bfloat16 cache the kernel computes the scores in AMX tiles
(csrc/paged_decode_amx.h). The kernel table's decode_attention says which (kernel_table.py).
Every path takes a sliding window and soft-capped scores. An int8 cache (rows of head_dim int8
values and their float32 scale, [2, blocks, bs, Hkv, head_dim + 4]) is read in place, in
vectors (csrc/paged_int8.h), under a query of any of DTYPES.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from . import kv_quant
from .kernels import LIBRARY

if TYPE_CHECKING:
    from .kernel_table import KernelTable

HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is instantiated for (small
# ones for the test models)
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)
# Engine calls let the kernel cut the batch's tokens into one span per thread.
AUTO_SPLIT = -1


def usable(kv_cache: torch.Tensor, table: KernelTable) -> bool:
    """Whether decode attention over this layer's cache [2, blocks, bs, Hkv, D] runs in the
    kernel (the query is on the cache's device)."""
    return (table.decode_attention.kernel and kv_cache.device.type == "cpu"
            and kv_cache.dtype in DTYPES and kv_quant.head_dim(kv_cache) in HEAD_DIMS)


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, split: int = AUTO_SPLIT,
                 tiles: bool = True, window: int | None = None,
                 softcap: float | None = None) -> torch.Tensor:
    """q [B, Hq, D] against one layer's cache [2, blocks, block_size, Hkv, D] (int8: D + 4,
    each row's values then its scale): row i sees
    its first context_lens[i] tokens through block_tables[i] (int64). Returns [B, Hq, D].

    `split`: tokens per work item (0: whole requests; AUTO_SPLIT: one span per thread).
    `tiles`: scores in AMX tiles where the CPU and shapes allow.
    `window`: row i sees only its last `window` tokens (a sliding window; None: all).
    `softcap`: scores s become softcap * tanh(s / softcap) (None: off).
    """
    if not LIBRARY.load():
        raise RuntimeError(f"paged decode kernel unavailable: {LIBRARY.reason}")
    return torch.ops.stallfree.paged_decode(q, kv_cache, block_tables, context_lens, scale,
                                            split, tiles, window or 0, softcap or 0.0)
