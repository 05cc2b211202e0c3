"""Copying checkpoint tensors into our fused and sharded parameters."""
from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch

from .llama import LlamaForCausalLM

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
    _PROJ = re.compile(
        r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")

    def __init__(self, model: LlamaForCausalLM) -> None:
        cfg, shard = model.config, model.shard
        self.config = cfg
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

    def locate(self, name: str) -> tuple[str, tuple[int, int] | None, int | None, int, int]:
        """Where checkpoint tensor `name` goes: (our parameter's name, its rows [lo, hi) or
        None for all, and the slice this rank reads: dimension or None, lo, hi)."""
        target, rows = name, None
        m = self._LAYER.match(name)
        if m:  # layer numbers are local to the stage
            target = f"model.layers.{int(m.group(1)) - self.first_layer}.{m.group(2)}"
        part = self._PROJ.search(name)
        key = part.group(1) if part else name.split(".")[-2]
        dim, lo, hi = self.slices.get(key, (None, 0, 0))
        if part and part.group(1) in self._FUSED:
            fused, index = self._FUSED[part.group(1)]
            target = target.replace(f".{part.group(1)}.", f".{fused}.")
            rows = self.row_ranges[fused][index]
        return target, rows, dim, lo, hi

    def load(self, name: str, fetch: Fetch) -> None:
        if not self.wants(name):
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
