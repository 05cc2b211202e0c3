"""Which part of the model one rank holds, and the collectives that join the parts.

Tensor parallelism (Megatron-style) splits attention by KV-head groups and the
MLP by intermediate columns: QKV and gate/up are column-parallel, o_proj and
down are row-parallel and followed by an all-reduce; the embedding and LM head
are split over the vocabulary. Splits may be uneven (SmolLM2 has 3 KV heads and
runs on 2 ranks): rank r takes a contiguous range whose sizes differ by at most
one. Pipeline parallelism gives each stage a contiguous range of layers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from .packing import PackedWeight


def split_range(total: int, parts: int, index: int) -> tuple[int, int]:
    """[lo, hi) of part `index` when `total` items are cut into `parts` near-equal runs."""
    if not 0 <= index < parts:
        raise ValueError(f"part {index} out of {parts}")
    base, extra = divmod(total, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


@dataclass(frozen=True)
class Shard:
    """This rank's coordinates; the default is the whole model in one process."""

    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    tp_group: Any = None  # torch.distributed ProcessGroup of this rank's TP peers

    @classmethod
    def of_rank(cls, rank: int, tp_size: int, pp_size: int, tp_group: Any = None) -> Shard:
        """Rank r is TP rank r % tp of pipeline stage r // tp."""
        return cls(rank % tp_size, tp_size, rank // tp_size, pp_size, tp_group)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def tp_range(self, total: int) -> tuple[int, int]:
        return split_range(total, self.tp_size, self.tp_rank)

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        return split_range(num_layers, self.pp_size, self.pp_rank)

    def check(self, num_layers: int, num_kv_heads: int) -> None:
        if num_kv_heads < self.tp_size:
            raise ValueError(f"tensor_parallel_size {self.tp_size} exceeds the model's "
                             f"{num_kv_heads} KV heads (each rank needs at least one)")
        if num_layers < self.pp_size:
            raise ValueError(f"pipeline_parallel_size {self.pp_size} exceeds the model's "
                             f"{num_layers} layers")

    # ---- collectives (no-ops on one rank) ------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.tp_group)
        return x

    def gather_vocab(self, local: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """[N, local vocab] on every rank -> [N, vocab] (all-gather, padded for uneven splits)."""
        if self.tp_size == 1:
            return local
        width = split_range(vocab_size, self.tp_size, 0)[1]  # the widest part is the first
        padded = torch.nn.functional.pad(local, (0, width - local.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(self.tp_size)]
        dist.all_gather(parts, padded.contiguous(), group=self.tp_group)
        sizes = [split_range(vocab_size, self.tp_size, r) for r in range(self.tp_size)]
        return torch.cat([p[:, :hi - lo] for p, (lo, hi) in zip(parts, sizes)], dim=-1)


class VocabParallelEmbedding(torch.nn.Module):
    """Rows [lo, hi) of the embedding; ids outside give zeros, and the all-reduce sums parts."""

    def __init__(self, vocab_size: int, hidden_size: int, shard: Shard) -> None:
        super().__init__()
        self.shard = shard
        self.lo, self.hi = shard.tp_range(vocab_size)
        self.weight = torch.nn.Parameter(torch.empty(self.hi - self.lo, hidden_size))

    # Set by the model's prepack where the LM head's packing holds this matrix and the
    # plain weight went (linear.repack): rows are read from the packing then.
    packed: PackedWeight | None = None
    # The model's dtype, for rows read from a quantized packing (dequantized in float32).
    dtype: torch.dtype = torch.float32

    def _rows(self, ids: torch.Tensor) -> torch.Tensor:
        if self.packed is None:
            return torch.nn.functional.embedding(ids, self.weight)
        return self.packed.rows(ids).to(self.dtype)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.shard.tp_size == 1:
            return self._rows(ids)
        mine = (ids >= self.lo) & (ids < self.hi)
        local = torch.where(mine, ids - self.lo, torch.zeros_like(ids))
        return self.shard.all_reduce(self._rows(local) * mine.unsqueeze(-1))
