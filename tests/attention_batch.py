"""Attention batches for the kernel tests: one random paged cache, requests whose block
tables are random blocks of it, and a batch run through `paged_attention` with the CPU
kernels where they can run or on the torch reference path."""
from __future__ import annotations

import random

import torch

from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.kernel_table import KernelTable, choose_kernels, default_kernels

ATTENTION = ("decode_attention", "prefill_attention")


def attention_kernels(kernel: bool, tiles: bool = True) -> KernelTable:
    """The default table (AMX tiles where the CPU has them), the kernels in vectors, or the
    reference path."""
    if kernel and tiles:
        return default_kernels()
    return choose_kernels({op: "vectors" if kernel else "torch" for op in ATTENTION})


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
               qkv: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
               tiles: bool = True, window: int | None = None,
               softcap: float | None = None) -> torch.Tensor:
        """The batch through `paged_attention` on the cache's device (q, k, v moved there),
        in the kernels (AMX tiles where `tiles` and the CPU allow) or on the reference path."""
        device = self.cache.device
        meta = AttentionMetadata.build(seqs, self.block_size, device, GatherWorkspace(),
                                       kernels=attention_kernels(kernel, tiles))
        return paged_attention(*(t.to(device) for t in qkv), self.cache, meta,
                               self.dim ** -0.5, window=window, softcap=softcap)

    def dense(self, seqs: list[tuple[int, int, list[int]]], q: torch.Tensor,
              window: int | None = None, softcap: float | None = None) -> torch.Tensor:
        """The naive truth in float64, from the cache as it is (the batch's K/V written):
        each request's keys read slot by slot, every score formed, soft-capped, masked
        (causal, and to the last `window` positions) and softmaxed."""
        bs, outputs, row = self.block_size, [], 0
        k_all, v_all = (kv.reshape(-1, self.hkv, self.dim).double() for kv in self.cache.cpu())
        group = self.hq // self.hkv
        for start, n, table in seqs:
            ctx = start + n
            slots = torch.tensor([table[p // bs] * bs + p % bs for p in range(ctx)])
            k, v = (kv[slots].repeat_interleave(group, 1) for kv in (k_all, v_all))
            scores = torch.einsum("qhd,khd->hqk", q[row:row + n].double().cpu(), k)
            scores = scores * self.dim ** -0.5
            if softcap is not None:
                scores = softcap * torch.tanh(scores / softcap)
            q_pos, k_pos = torch.arange(start, ctx)[:, None], torch.arange(ctx)[None, :]
            seen = k_pos <= q_pos
            if window is not None:
                seen &= k_pos > q_pos - window
            weights = scores.masked_fill(~seen, float("-inf")).softmax(-1)
            outputs.append(torch.einsum("hqk,khd->qhd", weights, v))
            row += n
        return torch.cat(outputs)

    def both(self, seqs: list[tuple[int, int, list[int]]]) -> tuple[torch.Tensor, torch.Tensor]:
        """(kernel, reference) outputs of one batch (both write the same new K/V)."""
        qkv = self.qkv(sum(n for _, n, _ in seqs))
        return self.attend(seqs, True, qkv), self.attend(seqs, False, qkv)

    def decodes(self, contexts: list[int]) -> list[tuple[int, int, list[int]]]:
        return [(c - 1, 1, self.table(c)) for c in contexts]
