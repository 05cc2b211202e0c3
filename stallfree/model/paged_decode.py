"""The CPU decode-attention kernel (csrc/paged_decode.cpp) and whether a call can use it.

Without the kernel library (see kernels.py), on a non-CPU device or another head size,
decode attention takes the torch path of attention.py, which stays the reference.
STALLFREE_PAGED_DECODE=0 turns the kernel off. On a CPU with AMX and a bfloat16 cache the
kernel computes the scores in AMX tiles (csrc/paged_decode_amx.h);
STALLFREE_AMX_ATTENTION=0 keeps its vector path.
"""
from __future__ import annotations

from contextlib import AbstractContextManager

import torch

from .kernels import LIBRARY, KernelSwitch

HEAD_DIMS = (16, 32, 64, 128)  # the head sizes the kernel is instantiated for (small
# ones for the test models)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Engine calls let the kernel cut the batch's tokens into one span per thread.
AUTO_SPLIT = -1
SWITCH = KernelSwitch("STALLFREE_PAGED_DECODE")
TILES = KernelSwitch("STALLFREE_AMX_ATTENTION")


def kernel_enabled(enabled: bool) -> AbstractContextManager[None]:
    """Decode attention in the kernel (True, where usable) or the torch path (False) inside
    the block: for comparisons and side-by-side benchmarks."""
    return SWITCH.within(enabled)


def usable(kv_cache: torch.Tensor) -> bool:
    """Whether decode attention over this layer's cache [2, blocks, bs, Hkv, D] runs in the
    kernel (the query is on the cache's device)."""
    return (kv_cache.device.type == "cpu" and kv_cache.dtype in DTYPES
            and kv_cache.shape[-1] in HEAD_DIMS and SWITCH.usable())


def paged_decode(q: torch.Tensor, kv_cache: torch.Tensor, block_tables: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, split: int = AUTO_SPLIT,
                 tiles: bool | None = None) -> torch.Tensor:
    """q [B, Hq, D] against one layer's cache [2, blocks, block_size, Hkv, D]: row i sees
    its first context_lens[i] tokens through block_tables[i] (int64). Returns [B, Hq, D].

    `split`: tokens per work item (0: whole requests; AUTO_SPLIT: one span per thread).
    `tiles`: scores in AMX tiles where the CPU and shapes allow (default: the switch).
    """
    if not LIBRARY.load():
        raise RuntimeError(f"paged decode kernel unavailable: {LIBRARY.reason}")
    return torch.ops.stallfree.paged_decode(q, kv_cache, block_tables, context_lens, scale,
                                            split, TILES.enabled if tiles is None else tiles)
