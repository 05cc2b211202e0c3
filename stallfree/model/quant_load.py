"""The `quantization` setting at load: which matmul weights stay quantized, and their rows
installed as the modules' packings (packing.PackedWeight with a quant_formats layout).

`auto` keeps each GGUF weight of a type quant_formats reads (Q4_0, Q4_1, Q4_K, Q5_K, Q6_K,
Q8_0) quantized wherever the quantized matmul kernel runs: CPU, the kernel library built,
one tensor-parallel rank (a row-parallel shard would cut K inside the blocks). The weight is
never dequantized: a model is held once, at a fraction of its float size. `none`
dequantizes every weight to the model's dtype at load. `int8` quantizes every matmul
weight of a float checkpoint (or of a dequantized GGUF) to per-output-channel int8 after
loading.
"""
from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..config import QUANTIZATION_CHOICES
from .config import ModelConfig
from .gguf import gguf_quant_rows
from .kernels import unavailable_reason
from .packing import PackedWeight
from .parallel import Shard, VocabParallelEmbedding
from .quant_formats import FORMATS, QuantFormat, fuse, gguf_format, quantize_int8
from .weights import WeightFiller

logger = logging.getLogger("stallfree.model")

__all__ = ["QUANTIZATION_CHOICES", "GGUFQuantPlan", "describe", "keep_gguf_types_reason",
           "quantize_to_int8", "weight_types"]
_FUSED_PARTS = {"qkv_proj": 3, "gate_up_proj": 2}


def keep_gguf_types_reason(quantization: str, device: torch.device, shard: Shard) -> str | None:
    """Why a GGUF file's quantized weights are dequantized at load (None: they stay)."""
    if quantization != "auto":
        return f"quantization={quantization}"
    if device.type != "cpu":
        return f"no quantized matmul kernel on {device.type}"
    if shard.tp_size > 1:
        return "tensor parallelism would cut the quantized blocks"
    if unavailable_reason() is not None:
        return f"the CPU kernels are not built ({unavailable_reason()})"
    return None


@dataclass
class GGUFQuantPlan:
    """Which modules of `model` take their weight from quantized GGUF tensors."""

    # module name -> {fused part index: (GGUF tensor, HF name)}
    modules: dict[str, dict[int, tuple[object, str]]] = field(default_factory=dict)

    @property
    def names(self) -> set[str]:
        """The HF tensor names loaded as quant rows (the filler skips them)."""
        return {name for parts in self.modules.values() for _, name in parts.values()}

    @classmethod
    def build(cls, meta_model: nn.Module, named: Iterable[tuple[str, object]]) -> GGUFQuantPlan:
        """From (HF name, GGUF tensor) pairs: a module is kept quantized where every tensor
        its weight is made of has a quantized format."""
        filler = WeightFiller(meta_model)
        found: dict[str, dict[int, tuple[object, str]]] = defaultdict(dict)
        refused: set[str] = set()
        whole_tensors: set[str] = set()  # fused in the checkpoint itself (Phi-3's qkv, gate_up)
        for name, tensor in named:
            if not name.endswith(".weight") or not filler.wants(name):
                continue
            target, rows, *_ = filler.locate(name)
            module = target.removesuffix(".weight")
            if gguf_format(tensor.tensor_type) is None:
                refused.add(module)
                continue
            if rows is None:
                whole_tensors.add(module)
                index = 0
            else:
                index = filler.row_ranges[module.rsplit(".", 1)[1]].index(rows)
            found[module][index] = (tensor, name)
        modules = dict(meta_model.named_modules())
        plan = cls()
        for module, parts in found.items():
            kind = modules.get(module)
            whole = (module in whole_tensors
                     or len(parts) == _FUSED_PARTS.get(module.rsplit(".", 1)[-1], 1))
            if module not in refused and whole and isinstance(kind, (nn.Linear,
                                                                    VocabParallelEmbedding)):
                plan.modules[module] = parts
        return plan

    def drop_weights(self, meta_model: nn.Module) -> None:
        """Remove the kept modules' float weights before the model's storage is allocated."""
        for module in self.modules:
            meta_model.get_submodule(module).weight = None

    def install(self, model: nn.Module, config: ModelConfig) -> None:
        """Read each kept module's quant rows (fusing its parts) into its packing."""
        for module_name, parts in self.modules.items():
            k = None
            rows = []
            for index in sorted(parts):
                tensor, name = parts[index]
                k = int(tensor.shape[0])
                rows.append((gguf_quant_rows(tensor, name, config),
                             gguf_format(tensor.tensor_type)))
            fused, fmt = fuse(rows, k)
            install(model, module_name, panels(fused, fmt, k))
        if self.modules:
            logger.info("weights kept quantized: %s", describe(model))


def panels(rows: torch.Tensor, fmt: QuantFormat, k: int) -> PackedWeight:
    """Quant rows reordered into the kernel's panels (csrc/quant_panels.h: 8 rows side by
    side per block), which the packing holds instead: the model keeps one copy."""
    data = torch.ops.stallfree.quant_pack_panels(rows.contiguous(), k, fmt.code)
    return PackedWeight(data, fmt.name, (rows.shape[0], k))


def install(model: nn.Module, module_name: str, packed: PackedWeight) -> None:
    module = model.get_submodule(module_name)
    want = ((module.out_features, module.in_features) if isinstance(module, nn.Linear)
            else (module.hi - module.lo, model.config.hidden_size))
    if tuple(packed.shape) != want:
        raise ValueError(f"{module_name}: the checkpoint's quantized weight has shape "
                         f"{tuple(packed.shape)}, expected {want}")
    module.weight = None
    module.packed = packed
    if isinstance(module, VocabParallelEmbedding) and model.logits_from_embedding:
        model.logits_packed = packed  # the tied LM head reads the same rows


def quantize_to_int8(model: nn.Module) -> None:
    """Every matmul weight (K a multiple of 32) as per-output-channel int8 rows, the float
    copy freed; the tied embedding's too, since it is the LM head."""
    targets = [(name, m) for name, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.weight is not None]
    if model.logits_from_embedding and model.model.embed_tokens.weight is not None:
        targets.append(("model.embed_tokens", model.model.embed_tokens))
    reason = unavailable_reason()
    if reason is not None:
        raise ValueError(f"quantization=int8 needs the CPU kernels: {reason}")
    for name, module in targets:
        weight = module.weight
        if weight.dim() == 2 and weight.shape[1] % 32 == 0:
            install(model, name, panels(quantize_int8(weight.detach()), FORMATS["q8_32"],
                                        weight.shape[1]))
    logger.info("weights quantized to int8: %s", describe(model))


def weight_types(model: nn.Module) -> dict[str, int]:
    """Matmul weights per type: a quant_formats name, or the float dtype's name."""
    counts: dict[str, int] = defaultdict(int)
    seen: set[int] = set()  # a tied embedding's packing is the LM head's: counted once
    for module in model.modules():
        packed = getattr(module, "packed", None)
        if not isinstance(module, nn.Linear) and packed is None or id(packed) in seen:
            continue
        if packed is not None:
            seen.add(id(packed))
        if packed is not None and packed.quant is not None:
            counts[packed.layout] += 1
        else:  # a float weight, plain or in a packing that replaced it
            tensor = module.weight if module.weight is not None else packed.data
            counts[str(tensor.dtype).removeprefix("torch.")] += 1
    return dict(counts)


def describe(model: nn.Module) -> str:
    """'q4_32 x120, q8_32 x1 (...)': the weight types and what they take in memory."""
    types = weight_types(model)
    formats: dict[str, QuantFormat] = {n: FORMATS[n] for n in types if n in FORMATS}
    return ", ".join(f"{name} x{count}" + (f" ({formats[name].bits_per_weight():g} bits/weight)"
                                             if name in formats else "")
                     for name, count in sorted(types.items()))

