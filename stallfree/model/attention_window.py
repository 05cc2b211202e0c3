"""What the torch path of paged attention (attention.py) precomputes for a batch, per sliding
window, and its soft-capped attention.

A sliding window of W (Mistral's every layer, Gemma's local ones) lets a query at position p
see only keys (p - W, p]; None is full causal attention. The layers of one forward pass may
use different windows (Gemma alternates W and None), so a batch holds one `TorchPlan` per
window in use, built by the first layer that asks for it and reused by every later one. A
window at least as long as every context in the batch hides nothing: it shares the plan of
None (and the kernels run without it), so those batches give full attention's exact bits.

The cache keeps every token; a windowed plan only gathers the blocks its queries can see,
so a long context costs the torch path no more than its window.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from ..attention_plan import decode_groups
from . import kv_quant

if TYPE_CHECKING:
    from .attention import AttentionMetadata

# One decode call: (rows in the batch's decodes or None for all in order, blocks [g, nb],
# key mask [g, 1, 1, nb * block_size] bool).
DecodeCall = tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]


@dataclass
class TorchPlan:
    """The torch path's gathers and masks for one window; None where the kernel runs."""

    # Per chunk: the blocks covering the keys it sees and its additive mask over them
    # [query_len, keys]; (None, mask) when it has no cached prefix (it attends to its own
    # K/V under the mask), (None, None) when the mask would be plain causal (SDPA's own).
    prefill_blocks: list[torch.Tensor | None] | None = None
    prefill_masks: list[torch.Tensor | None] | None = None
    # Decodes in groups of similar span (stallfree/attention_plan.py), each padded to its
    # longest.
    decode: list[DecodeCall] | None = None
    # The causal masks of (None, None) chunks, for soft-capped attention (SDPA cannot cap):
    # made on first use, by chunk.
    causal: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def chunk_mask(self, i: int, query_len: int, device: torch.device) -> torch.Tensor:
        """Chunk i's mask made explicit (additive, [query_len, query_len] if it was plain
        causal)."""
        mask = self.prefill_masks[i]
        if mask is not None:
            return mask
        if i not in self.causal:
            self.causal[i] = additive_mask(query_len, query_len, 0, None, torch.float32, device)
        return self.causal[i]


NO_PLAN = TorchPlan()  # read where a batch built none: every part runs in the kernels


def build_plan(meta: AttentionMetadata, kv_cache: torch.Tensor, window: int | None,
               prefill: bool, decode: bool) -> TorchPlan:
    """The plan of `window` for the batch's prefill chunks (where `prefill`) and decodes
    (where `decode`) over one layer's cache [2, blocks, bs, Hkv, W]."""
    plan = TorchPlan()
    if prefill:
        # Additive masks in the dtype attention computes in (an int8 cache's: float32).
        plan.prefill_blocks, plan.prefill_masks = _prefill_plan(
            meta, kv_quant.compute_dtype(kv_cache.dtype), window)
    if decode:
        plan.decode = _decode_plan(meta, kv_cache, window)
    return plan


def additive_mask(query_len: int, context: int, base: int, window: int | None,
                  dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """[query_len, context - base]: 0 where the chunk's query i (at position
    context - query_len + i) sees key base + j, -inf elsewhere. Additive, once: SDPA turns
    a boolean mask into this at every layer's call."""
    q_pos = torch.arange(context - query_len, context, device=device)[:, None]
    k_pos = torch.arange(base, context, device=device)[None, :]
    visible = k_pos <= q_pos
    if window is not None:
        visible &= k_pos > q_pos - window
    return torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible,
                                                                               float("-inf"))


def _prefill_plan(meta: AttentionMetadata, dtype: torch.dtype, window: int | None
                  ) -> tuple[list[torch.Tensor | None], list[torch.Tensor | None]]:
    bs = meta.block_size
    blocks: list[torch.Tensor | None] = []
    masks: list[torch.Tensor | None] = []
    for qlen, ctx, table in zip(meta.prefill_query_lens, meta.prefill_context_lens,
                                meta.prefill_table):
        if ctx == qlen and (window is None or ctx <= window):
            blocks.append(None)  # attends to its own K/V, plainly causal
            masks.append(None)
            continue
        if ctx == qlen:  # its own K/V, the oldest hidden from its last queries
            blocks.append(None)
            masks.append(additive_mask(qlen, ctx, 0, window, dtype, table.device))
            continue
        # The gather starts at the block of the first key its first query sees.
        first = 0 if window is None else max(0, ctx - qlen - window + 1) // bs
        blocks.append(table[first:-(-ctx // bs)])
        masks.append(additive_mask(qlen, ctx, first * bs, window, dtype, table.device))
    return blocks, masks


def call_cap_bytes_per_token(kv_cache: torch.Tensor) -> int:
    """One layer's K+V bytes per token as attention reads them (an int8 cache's rows
    dequantized to float32) where calls are capped to stay in the CPU caches; 0 elsewhere:
    on a GPU the cap would only multiply kernel launches."""
    if kv_cache.device.type != "cpu":
        return 0
    dtype = kv_quant.compute_dtype(kv_cache.dtype)
    return 2 * kv_cache.shape[-2] * kv_quant.head_dim(kv_cache) * dtype.itemsize


def _decode_plan(meta: AttentionMetadata, kv_cache: torch.Tensor, window: int | None
                 ) -> list[DecodeCall]:
    bs, lens = meta.block_size, meta.decode_lens
    # Each row's first gathered block (where its window starts) and the tokens from there.
    first = [0 if window is None else max(0, c - window) // bs for c in lens]
    spans = [c - f * bs for c, f in zip(lens, first)]
    groups = decode_groups(spans, bs, call_cap_bytes_per_token(kv_cache))
    device = meta.decode_context_lens.device
    plan: list[DecodeCall] = []
    for group in groups:
        # Gather only the blocks the group's longest span needs.
        num_blocks = -(-spans[group[0]] // bs)
        # Order within a group does not matter: a lone group keeps the batch's.
        rows = None if len(groups) == 1 else \
            torch.tensor(group, dtype=torch.int64, device=device)
        tables, ctx = meta.decode_block_tables, meta.decode_context_lens
        if rows is not None:
            tables, ctx = tables.index_select(0, rows), ctx.index_select(0, rows)
        key_pos = torch.arange(num_blocks * bs, device=device)[None, :]
        if window is None:
            blocks, mask = tables[:, :num_blocks], key_pos < ctx[:, None]
        else:
            start = torch.tensor([first[i] for i in (group if rows is not None else
                                                     range(len(lens)))],
                                 dtype=torch.int64, device=device)[:, None]
            # A shorter span's tail repeats its own last block (masked): its table's
            # padding may end before start + num_blocks.
            last = (ctx[:, None] - 1) // bs
            index = torch.minimum(start + torch.arange(num_blocks, device=device), last)
            blocks = tables.gather(1, index)
            key_pos = key_pos + start * bs
            mask = (key_pos < ctx[:, None]) & (key_pos >= ctx[:, None] - window)
        plan.append((rows, blocks, mask[:, None, None, :]))
    return plan


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                     scale: float, softcap: float) -> torch.Tensor:
    """softmax(softcap * tanh(q k^T * scale / softcap) + mask) v in float32, as transformers'
    eager Gemma 2 attention caps its scores. q [..., Lq, D], k and v [..., Lk, D] (leading
    dims broadcast: GQA folds a KV head's query heads into q's), mask broadcast to the
    scores [..., Lq, Lk]: boolean (True: seen) or additive. Returns [..., Lq, D] in q's
    dtype."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    else:
        scores = scores + mask.float()
    return torch.matmul(torch.softmax(scores, dim=-1), v.float()).to(q.dtype)
