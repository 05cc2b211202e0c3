"""Attention batches for the kernel tests: one random paged cache, requests whose block
tables are random blocks of it, and a batch run through `paged_attention` with the CPU
kernels where they can run or on the torch reference path."""
from __future__ import annotations

import random

import torch

from stallfree.model import paged_decode, paged_prefill
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.float() - ref.float()).abs().max() / ref.float().abs().max()).item()


class Batch:
    """A cache of `num_blocks` random blocks and requests whose tables are random blocks."""

    def __init__(self, heads: tuple[int, int, int], dtype: torch.dtype = torch.float32,
                 block_size: int = 16, num_blocks: int = 600, seed: int = 0) -> None:
        self.hq, self.hkv, self.dim = heads
        self.block_size, self.dtype = block_size, dtype
        self.gen = torch.Generator().manual_seed(seed)
        self.rng = random.Random(seed)
        self.cache = torch.randn(2, num_blocks, block_size, self.hkv, self.dim,
                                 generator=self.gen).to(dtype)
        self.free = list(range(num_blocks))
        self.rng.shuffle(self.free)

    def table(self, tokens: int) -> list[int]:
        n = -(-tokens // self.block_size)
        table, self.free = self.free[:n], self.free[n:]
        return table

    def qkv(self, rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q = torch.randn(rows, self.hq, self.dim, generator=self.gen).to(self.dtype)
        k, v = (torch.randn(rows, self.hkv, self.dim, generator=self.gen).to(self.dtype)
                for _ in range(2))
        return q, k, v

    def attend(self, seqs: list[tuple[int, int, list[int]]], kernel: bool,
               qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """The batch through `paged_attention` on the cache's device (q, k, v moved there)."""
        device = self.cache.device
        meta = AttentionMetadata.build(seqs, self.block_size, device, GatherWorkspace())
        with paged_decode.kernel_enabled(kernel), paged_prefill.kernel_enabled(kernel):
            return paged_attention(*(t.to(device) for t in qkv), self.cache, meta,
                                   self.dim ** -0.5)

    def both(self, seqs: list[tuple[int, int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel, reference) outputs of one batch (both write the same new K/V)."""
        qkv = self.qkv(sum(n for _, n, _ in seqs))
        return self.attend(seqs, True, qkv), self.attend(seqs, False, qkv)

    def decodes(self, contexts: list[int]) -> list[tuple[int, int, list[int]]]:
        return [(c - 1, 1, self.table(c)) for c in contexts]
