"""Paged attention over a flat batch of prefill chunks followed by decodes, in plain torch.

The KV cache of one layer is [2, num_blocks, block_size, num_kv_heads, head_dim];
token `p` of a request lives in slot `block_table[p // block_size] * block_size +
p % block_size` of the flattened [num_blocks * block_size] view.

On CPU, decodes run in the C++ kernel of paged_decode.py and prefill chunks in that of
paged_prefill.py (a float32 cache, or a bfloat16 one on a CPU with AVX512_BF16), both reading
the cache in place; elsewhere, without the kernels, or where the kernel table says so
(`AttentionMetadata.kernels`), they gather their blocks and run SDPA (the reference), or with
soft-capped scores the float32 math of attention_window.capped_attention. A layer may attend
through a sliding window (attention_window.py).

An int8 cache (kv_quant.py: [2, blocks, block_size, Hkv, D + 4], each row's values and
float32 scale) is written here quantized, and the torch path dequantizes its gathered rows
to the query's dtype before SDPA; a chunk attending to its own keys sees them as the cache
holds them, so results do not depend on the chunking or on prefix-cache hits.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from ..attention_plan import attends_as_decode
from . import kv_quant
from . import paged_prefill as prefill_kernel
from .attention_window import (
    NO_PLAN,
    DecodeCall,
    TorchPlan,
    build_plan,
    call_cap_bytes_per_token,
    capped_attention,
)
from .kernel_table import KernelTable, ensure
from .paged_decode import paged_decode, usable

__all__ = ["AttentionMetadata", "GatherWorkspace", "call_cap_bytes_per_token",
           "paged_attention", "slot_mapping"]


def slot_mapping(seqs: list[tuple[int, int, list[int]]], block_size: int) -> list[int]:
    """The cache slot of every new token, in batch-row order: block by block, a run of
    consecutive slots each. In plain Python: with the dozen torch ops on a few values that
    computed it, the metadata took 0.22 ms of a batch-1 decode step in the engine, 0.07
    without them (2-core EPYC, docs/benchmarks.md)."""
    slots: list[int] = []
    for start, num_tokens, table in seqs:
        pos, end = start, start + num_tokens
        while pos < end:
            block, offset = divmod(pos, block_size)
            run = min(end - pos, block_size - offset)
            first = table[block] * block_size + offset
            slots.extend(range(first, first + run))
            pos += run
    return slots


class GatherWorkspace:
    """The reused destination of KV gathers: one buffer for K and one for V.

    A decode batch of a loaded server gathers tens of MB per layer. Fresh tensors that
    large come from mmap, so every layer page-faults its whole gather in again: on
    CPU that made the gather about 3x slower past ~40K tokens, at a point that moved
    with the allocator's history. Writing into one buffer that only grows makes the
    cost per gathered token flat and repeatable.
    """

    def __init__(self) -> None:
        self._buffer: torch.Tensor | None = None

    def gather(self, kv_cache: torch.Tensor, blocks: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """One layer's cache [2, num_blocks, bs, Hkv, W] and [n] block ids -> K and V
        [n * bs, Hkv, W] in the cache's dtype (an int8 cache's rows still quantized:
        kv_quant.dequantize), valid until the next gather.

        index_select on the leading dim copies whole blocks and is several times faster
        on CPU than advanced indexing or per-slot gathers.
        """
        n = int(blocks.shape[0])
        buf = self._buffer
        if (buf is None or buf.shape[1] < n or buf.shape[2:] != kv_cache.shape[2:]
                or buf.dtype != kv_cache.dtype or buf.device != kv_cache.device):
            # Grow with headroom so a slowly rising load does not reallocate every step.
            size = max(n + n // 4, buf.shape[1] if buf is not None else 0)
            buf = self._buffer = kv_cache.new_empty((2, size, *kv_cache.shape[2:]))
        k = torch.index_select(kv_cache[0], 0, blocks, out=buf[0, :n])
        v = torch.index_select(kv_cache[1], 0, blocks, out=buf[1, :n])
        return k.flatten(0, 1), v.flatten(0, 1)


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot of every new token
    num_prefill_tokens: int  # rows [0, num_prefill_tokens) are prefill chunks
    prefill_query_lens: list[int]
    prefill_context_lens: list[int]  # keys a chunk sees: cached tokens before it + its own length
    prefill_table: torch.Tensor  # [chunks, max_blocks] int64: each chunk's block table, padded
    decode_context_lens: torch.Tensor  # [B] int64, includes the new token
    decode_block_tables: torch.Tensor  # [B, max_blocks] int64, padded
    block_size: int
    # The decode context lengths on the host: the decode plan reads them, which from the
    # tensor would be a read back from a GPU at every step.
    decode_lens: list[int]
    # Derived once per batch by `prepare()` and reused by every layer.
    # Where the prefill kernel runs the chunks: its query and context lengths [chunks].
    prefill_kernel_lens: tuple[torch.Tensor, torch.Tensor] | None = field(default=None,
                                                                          repr=False)
    # Where the torch path runs chunks or decodes: its gathers and masks, per sliding window
    # (None: full attention; attention_window.py). Gathers copy whole blocks (contiguous
    # runs), not single slots.
    torch_plans: dict[int | None, TorchPlan] = field(default_factory=dict, repr=False)
    # Where gathers land; the runner passes one that lives as long as its KV cache.
    workspace: GatherWorkspace = field(default_factory=GatherWorkspace, repr=False)
    # Which attention paths run: the model's table (its forward sets it); None, the defaults.
    kernels: KernelTable | None = field(default=None, repr=False)
    _prepared: bool = field(default=False, init=False, repr=False)
    _longest: int | None = field(default=None, init=False, repr=False)

    @property
    def num_decode_tokens(self) -> int:
        return int(self.decode_context_lens.shape[0])

    # Full attention's torch plan (None where the kernels run), as it was read before windows.
    @property
    def prefill_masks(self) -> list[torch.Tensor | None] | None:
        return self.torch_plans.get(None, NO_PLAN).prefill_masks

    @property
    def decode_plan(self) -> list[DecodeCall] | None:
        return self.torch_plans.get(None, NO_PLAN).decode

    @classmethod
    def build(cls, seqs: list[tuple[int, int, list[int]]], block_size: int,
              device: torch.device | str, workspace: GatherWorkspace | None = None,
              pad_block: int = 0, kernels: KernelTable | None = None) -> AttentionMetadata:
        """seqs in batch-row order: (start_pos, num_new_tokens, block_table).

        start_pos is the number of tokens already cached. Entries with more than one
        new token (prefill chunks) must precede single-token entries (decodes).
        `pad_block` fills the decode tables of shorter rows: masked keys still enter
        the product (0 x NaN is NaN), so it should be a block nobody writes (the
        runner keeps one zeroed), not another request's.
        """
        seen_decode = False
        for i, (start, n, table) in enumerate(seqs):
            if n < 1 or start < 0:
                raise ValueError(f"seq {i}: need start_pos >= 0 and num_new_tokens >= 1, "
                                 f"got ({start}, {n})")
            if len(table) * block_size < start + n:
                raise ValueError(f"seq {i}: block table of {len(table)} blocks cannot hold "
                                 f"{start + n} tokens at block_size {block_size}")
            if attends_as_decode(n):
                seen_decode = True
            elif seen_decode:
                raise ValueError("prefill chunks (num_new_tokens > 1) must come before decodes")

        # One tensor from padded lists: a copy per row cost ~10 us a sequence.
        width = max(max((len(t) for _, _, t in seqs), default=0), 1)
        tables = torch.tensor([[*t, *[pad_block] * (width - len(t))] for _, _, t in seqs],
                              dtype=torch.int64).view(len(seqs), width)
        slots = torch.tensor(slot_mapping(seqs, block_size), dtype=torch.int64)

        prefills = [(s, n, t) for s, n, t in seqs if not attends_as_decode(n)]
        decodes = [(s, n, t) for s, n, t in seqs if attends_as_decode(n)]
        dec_blocks = max((len(t) for _, _, t in decodes), default=1)
        decode_lens = [s + 1 for s, _, _ in decodes]
        meta = cls(
            slot_mapping=slots.to(device),
            num_prefill_tokens=sum(n for _, n, _ in prefills),
            prefill_query_lens=[n for _, n, _ in prefills],
            prefill_context_lens=[s + n for s, n, _ in prefills],
            prefill_table=tables[:len(prefills)].contiguous().to(device),
            decode_context_lens=torch.tensor(decode_lens, dtype=torch.int64).to(device),
            decode_block_tables=tables[len(prefills):, :dec_blocks].contiguous().to(device),
            block_size=block_size,
            decode_lens=decode_lens,
            workspace=workspace or GatherWorkspace(),
            kernels=kernels,
        )
        return meta

    def effective_window(self, window: int | None) -> int | None:
        """`window` as this batch needs it: None where it hides nothing (no context in the
        batch is longer), so such a batch runs full attention's plan and kernels."""
        if window is None:
            return None
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be a positive int or None, got {window!r}")
        if self._longest is None:
            self._longest = max(self.prefill_context_lens + self.decode_lens, default=0)
        return None if window >= self._longest else window

    def prepare(self, kv_cache: torch.Tensor, windows: Iterable[int | None] = (None,)) -> None:
        """The kernels' lengths, or the torch path's gathers and masks for each of `windows`,
        for one layer's cache [2, blocks, bs, Hkv, D] (the same shape in every layer).
        Idempotent: the first layer that asks for a window does the work. The model may name
        every window its layers use up front; any other is prepared when first used."""
        kernels = self.kernels = ensure(self.kernels)
        if not self._prepared:  # decided once per batch: every window takes the same path
            self._prepared = True
            if self.prefill_query_lens and prefill_kernel.usable(kv_cache, kernels):
                device = self.prefill_table.device
                self.prefill_kernel_lens = (
                    torch.tensor(self.prefill_query_lens, dtype=torch.int64, device=device),
                    torch.tensor(self.prefill_context_lens, dtype=torch.int64, device=device))
        prefill, decode = self.prefill_kernel_lens is None, not usable(kv_cache, kernels)
        if not (prefill or decode):
            return
        for window in windows:
            window = self.effective_window(window)
            if window not in self.torch_plans:
                self.torch_plans[window] = build_plan(self, kv_cache, window, prefill, decode)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                    kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                    cache_written: bool = False, window: int | None = None,
                    softcap: float | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D]; kv_cache: one layer [2, blocks, block_size, Hkv, W]
    (W = D, or D + 4 for an int8 cache: kv_quant.py).

    Writes k/v into the cache (unless `cache_written`: the caller did), returns attention
    output [T, Hq, D]. `window`: a query at position p sees only keys (p - window, p], as
    transformers' sliding-window mask (None: every key before it). `softcap`: scores
    s = q.k * scale become softcap * tanh(s / softcap) before the mask and the softmax, as
    Gemma 2's attn_logit_softcapping (None: off).
    """
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be > 0 or None, got {softcap!r}")
    window = meta.effective_window(window)
    if not cache_written:
        kv_quant.write(kv_cache, meta.slot_mapping, k, v)
    meta.prepare(kv_cache, (window,))
    plan = meta.torch_plans.get(window)

    row, table = meta.num_prefill_tokens, meta.kernels
    if meta.prefill_kernel_lens is not None:
        # q in the cache's float dtype; over an int8 cache, in its own.
        outputs = [prefill_kernel.paged_prefill(
            q[:row].to(kv_quant.compute_dtype(kv_cache.dtype, q.dtype)), kv_cache,
            meta.prefill_table, *meta.prefill_kernel_lens, scale,
            tiles=table.prefill_attention.impl == "amx", window=window,
            softcap=softcap).to(q.dtype)]
    else:
        outputs = _torch_prefills(q, k, v, kv_cache, meta, plan, scale, softcap)

    num_decodes = q.shape[0] - row
    if num_decodes > 0 and usable(kv_cache, table):
        outputs.append(paged_decode(q[row:], kv_cache, meta.decode_block_tables,
                                    meta.decode_context_lens, scale,
                                    tiles=table.decode_attention.impl == "amx", window=window,
                                    softcap=softcap))
    elif num_decodes > 0:
        qd, calls, ws = q[row:], plan.decode, meta.workspace
        if len(calls) == 1:
            outputs.append(_decode(qd, kv_cache, calls[0][1], calls[0][2], ws, scale, softcap))
        else:
            out = torch.empty_like(qd)
            for rows, blocks, mask in calls:
                out.index_copy_(0, rows, _decode(qd.index_select(0, rows), kv_cache, blocks,
                                                 mask, ws, scale, softcap))
            outputs.append(out)

    return outputs[0] if len(outputs) == 1 else torch.cat(outputs, dim=0)


def _torch_prefills(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor,
                    meta: AttentionMetadata, plan: TorchPlan, scale: float,
                    softcap: float | None) -> list[torch.Tensor]:
    """The reference path for the batch's prefill chunks: one SDPA call each (or, capped,
    the float32 math), over its own K/V or, with a cached prefix, over its gathered
    context (from its window's first block), under the plan's mask."""
    outputs, row = [], 0
    if kv_quant.is_quantized(kv_cache.dtype) and None in plan.prefill_blocks:
        # The chunks that attend to their own keys see them as the cache holds them.
        end = meta.num_prefill_tokens
        k, v = (kv_quant.as_cached(x[:end], kv_cache.dtype) for x in (k, v))
    for i, qlen in enumerate(meta.prefill_query_lens):
        # [1, H, L, D] views for SDPA.
        qi = q[row:row + qlen].transpose(0, 1).unsqueeze(0)
        blocks, mask = plan.prefill_blocks[i], plan.prefill_masks[i]
        if blocks is None:
            ki = k[row:row + qlen].transpose(0, 1).unsqueeze(0)
            vi = v[row:row + qlen].transpose(0, 1).unsqueeze(0)
        else:
            keys = mask.shape[-1]
            ki, vi = (kv_quant.dequantize(kv[:keys], q.dtype).transpose(0, 1).unsqueeze(0)
                      for kv in meta.workspace.gather(kv_cache, blocks))
        if softcap is not None:
            # A KV head's query heads folded together: [Hkv, group, L, D] against [Hkv, 1, ...].
            hkv, (_, hq, _, dim) = ki.shape[1], qi.shape
            out = capped_attention(qi.reshape(hkv, hq // hkv, qlen, dim), ki.transpose(0, 1),
                                   vi.transpose(0, 1), plan.chunk_mask(i, qlen, q.device),
                                   scale, softcap).reshape(1, hq, qlen, dim)
        elif mask is None:
            out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale,
                                                 enable_gqa=True)
        else:
            out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask.to(q.dtype),
                                                 scale=scale, enable_gqa=True)
        outputs.append(out[0].transpose(0, 1))
        row += qlen
    return outputs


def _decode(q: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, mask: torch.Tensor,
            workspace: GatherWorkspace, scale: float, softcap: float | None) -> torch.Tensor:
    """One query per request [g, Hq, D] against its gathered blocks [g, nb]."""
    num, num_heads, head_dim = q.shape
    num_kv_heads = kv_cache.shape[-2]
    kd, vd = (kv_quant.dequantize(kv, q.dtype).view(num, -1, num_kv_heads, head_dim)
              .transpose(1, 2) for kv in workspace.gather(kv_cache, blocks.flatten()))
    # Fold each KV head's group of query heads into the query-length axis, so GQA
    # needs no K/V expansion and one mask row serves all.
    qd = q.reshape(num, num_kv_heads, num_heads // num_kv_heads, head_dim)
    if softcap is not None:
        out = capped_attention(qd, kd, vd, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(qd, kd, vd, attn_mask=mask, scale=scale)
    return out.reshape(num, num_heads, head_dim)
