"""Copying checkpoint tensors into our fused and sharded parameters."""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch

from .decoder import CausalLM
from .families import family_of

Fetch = Callable[[int | None, int, int], torch.Tensor]  # (dim, lo, hi) -> that slice


class WeightFiller:
    """Copies checkpoint tensors (HF names) into our fused, sharded parameters.

    A rank reads only its slice of each tensor (`fetch` gets the dimension and
    range) and skips the tensors of other pipeline stages, so no rank ever holds
    the whole model. Completeness is checked row by row.
    """

    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)$")
    _EXPERT = re.compile(r"\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    _PROJ = re.compile(
        r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")

    def __init__(self, model: CausalLM) -> None:
        cfg, shard = model.config, model.shard
        self.config = cfg
        self.renames = [(re.compile(rf"{pattern}(?=\.)"), ours)
                        for pattern, ours in family_of(cfg).hf_layer_names.items()]
        self.params = dict(model.named_parameters())
        self.first_layer, self.end_layer = shard.layer_range(cfg.num_hidden_layers)
        hd = cfg.head_dim
        kv_lo, kv_hi = shard.tp_range(cfg.num_key_value_heads)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        q_rows = (kv_lo * group * hd, kv_hi * group * hd)
        kv_rows = (kv_lo * hd, kv_hi * hd)
        i_rows = shard.tp_range(cfg.intermediate_size)
        vocab_rows = shard.tp_range(cfg.vocab_size)
        # Checkpoint name part -> (dimension to slice, [lo, hi)); row-parallel layers
        # (o_proj, down_proj) are cut along their input dimension.
        self.slices = {"q_proj": (0, *q_rows), "k_proj": (0, *kv_rows), "v_proj": (0, *kv_rows),
                       "o_proj": (1, *q_rows), "gate_proj": (0, *i_rows), "up_proj": (0, *i_rows),
                       "down_proj": (1, *i_rows), "embed_tokens": (0, *vocab_rows),
                       "lm_head": (0, *vocab_rows)}
        q, kv, i = q_rows[1] - q_rows[0], kv_rows[1] - kv_rows[0], i_rows[1] - i_rows[0]
        self.row_ranges = {"qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
                           "gate_up_proj": [(0, i), (i, 2 * i)]}
        # A checkpoint's fused tensor -> its parts and their rows in the whole model.
        full_q, full_kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
        self.checkpoint_fused = {
            "qkv_proj": [("q_proj", full_q), ("k_proj", full_kv), ("v_proj", full_kv)],
            "gate_up_proj": [("gate_proj", cfg.intermediate_size),
                             ("up_proj", cfg.intermediate_size)]}
        self.filled: dict[str, int] = {}  # parameter name -> rows written

    def wants(self, name: str) -> bool:
        """False for tensors this rank does not hold (other stages, a tied copy, derived)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return False  # some tied checkpoints still store a copy
        if name.endswith("rotary_emb.inv_freq"):
            return False  # derived from the config; old checkpoints saved it
        m = self._LAYER.match(name)
        if m:
            return self.first_layer <= int(m.group(1)) < self.end_layer
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            return name in self.params  # only the stages that hold them
        return True  # unknown names fail loudly in load()

    def rename(self, name: str) -> str:
        """A checkpoint tensor's name in ours (the family's renames inside a layer)."""
        m = self._LAYER.match(name)
        if m is None:
            return name
        for pattern, ours in self.renames:
            if pattern.match(m.group(2)):
                return f"model.layers.{m.group(1)}.{pattern.sub(ours, m.group(2), count=1)}"
        return name

    def locate(self, name: str) -> tuple[str, tuple[int, int] | None, int | None, int, int]:
        """Where checkpoint tensor `name` (renamed) goes: (our parameter's name, its rows
        [lo, hi) or None for all, and the slice this rank reads: dimension or None, lo, hi)."""
        target, rows = name, None
        m = self._LAYER.match(name)
        if m:  # layer numbers are local to the stage
            target = f"model.layers.{int(m.group(1)) - self.first_layer}.{m.group(2)}"
        expert = self._EXPERT.search(target)
        if expert:
            return self._expert_rows(target, expert)
        part = self._PROJ.search(name)
        key = part.group(1) if part else name.split(".")[-2]
        dim, lo, hi = self.slices.get(key, (None, 0, 0))
        if part and part.group(1) in self._FUSED:
            fused, index = self._FUSED[part.group(1)]
            target = target.replace(f".{part.group(1)}.", f".{fused}.")
            rows = self.row_ranges[fused][index]
        return target, rows, dim, lo, hi

    def _expert_rows(self, target: str, m: re.Match) -> tuple[str, tuple[int, int], None, int,
                                                              int]:
        """Expert e's matrices stacked by rows (moe.SparseMoE's layout); whole, unsliced."""
        e, part = int(m.group(1)), m.group(2)
        prefix = target[:m.start()]
        if part == "down_proj":
            h = self.config.hidden_size
            return f"{prefix}.mlp.experts_down", (e * h, (e + 1) * h), None, 0, 0
        i = self.config.moe_intermediate_size
        lo = e * 2 * i + (i if part == "up_proj" else 0)
        return f"{prefix}.mlp.experts_gate_up", (lo, lo + i), None, 0, 0

    def load(self, name: str, fetch: Fetch) -> None:
        name = self.rename(name)
        if not self.wants(name):
            return
        owner, kind, suffix = (["", "", ""] + name.rsplit(".", 2))[-3:]
        if kind in self.checkpoint_fused:
            offset = 0
            for part, size in self.checkpoint_fused[kind]:
                self.load(f"{owner}.{part}.{suffix}", _rows_of(fetch, offset, size))
                offset += size
            return
        target, rows, dim, lo, hi = self.locate(name)
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        tensor = fetch(dim, lo, hi)
        dest = param if rows is None else param[rows[0]:rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        self.filled[target] = self.filled.get(target, 0) + dest.shape[0]

    def check_complete(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.shape[0]]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def _rows_of(fetch: Fetch, offset: int, size: int) -> Fetch:
    """The fetch of rows [offset, offset + size) of a fused tensor, as a tensor of its own
    (its parts are cut by rows; row-parallel cuts never apply to them)."""
    def part(dim: int | None, lo: int, hi: int) -> torch.Tensor:
        if dim == 1:
            raise ValueError("a fused checkpoint tensor cut by columns")
        return fetch(0, offset, offset + size) if dim is None else \
            fetch(0, offset + lo, offset + hi)
    return part


def add_norm_offset(model: CausalLM, offset: float) -> None:
    """Add `offset` to every RMSNorm weight (Gemma's checkpoints store w for (1 + w))."""
    if offset:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if name.endswith("norm.weight"):
                    param.add_(offset)


def slicer(get_full: Callable[[], np.ndarray | torch.Tensor]) -> Fetch:
    def fetch(dim: int | None, lo: int, hi: int) -> torch.Tensor:
        data = get_full()
        if dim is not None:
            data = data[lo:hi] if dim == 0 else data[:, lo:hi]
        if isinstance(data, np.ndarray):
            # Dequantised F32 data can be a read-only view of the mmap; copy only then.
            data = torch.from_numpy(np.require(data, requirements=["C", "W"]))
        return data
    return fetch
