"""A forward pass's decoder layers in one call to the CPU kernels (csrc/layer_loop.cpp).

Where every step of a layer runs in a kernel anyway (bf16 weights in the tile packing of
linear.py or float32 ones in its f32 packing, the fused norms and RoPE of layers.py, paged
attention in its kernels), the Python between those calls is all that is left to save: at
a one-row decode step it cost a fifth of the step (docs/benchmarks.md, "The layer loop in
C++"). The C++ loop runs the layers' steps (layer_steps.py), lowered here into records it
reads, with the same kernels in the same order, so its results are the Python path's to the
bit; the tests hold it to that. Anything else (tensor parallelism, a step it has no case
for, other dtypes, the kernel table's layer_loop or another op on its reference path, a
batch a kernel does not take) takes the Python layers, which stay the reference.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from . import layers as fused
from . import linear, paged_decode
from .attention import AttentionMetadata
from .kernel_table import KernelTable
from .layer_steps import NATIVE_ACTIVATIONS, Op, Step, native_reason
from .parallel import Shard

# csrc/layer_loop.cpp's record of a step: ints (op, first weight, quant format, features,
# flag) and two floats (a norm's eps; the attention's scale and softcap).
INTS_PER_STEP = 5


@dataclass
class _Program:
    """The steps lowered for the C++ loop, as they are added."""

    kind: str  # the packings' family: "f32" (float32) or "amx" (bf16 tiles)
    dtype: torch.dtype
    weights: list[torch.Tensor] = field(default_factory=list)
    ints: list[int] = field(default_factory=list)
    floats: list[float] = field(default_factory=list)
    final_norm: torch.Tensor | None = None  # the model's final norm weight, if it is a step
    # The records as tensors, made once by `_lower`: lists would be converted on every call.
    records: tuple[torch.Tensor, torch.Tensor] | None = None

    def add(self, op: Op, weights: Sequence[torch.Tensor], quant: int = 0, features: int = 0,
            flag: int = 0, values: tuple[float, float] = (0.0, 0.0)) -> None:
        self.ints += [int(op), len(self.weights), quant, features, flag]
        self.floats += values
        self.weights += weights

    def lower(self, step: Step, module: nn.Module, layer: int) -> str | None:
        """Adds `step` (its weights in `module`, its cache layer `layer`); else why not."""
        reason = native_reason(step)
        if reason is not None:
            return reason
        if step.op in (Op.ADD_NORM, Op.NORM, Op.QK_NORM):
            norms = [module.q_norm, module.k_norm] if step.op is Op.QK_NORM else [module]
            if any(norm.weight.dtype != self.dtype for norm in norms):
                return f"{step.module}'s weight is not in the model's dtype"
            self.add(step.op, [norm.weight for norm in norms],
                     values=tuple(norm.eps for norm in norms) + (0.0,) * (2 - len(norms)))
        elif step.op is Op.ATTEND:
            self.add(step.op, [], features=layer, values=(module.scale, step.softcap or 0.0))
        else:
            act = NATIVE_ACTIVATIONS[step.act] if step.op is Op.GATED else 0
            reason = self._packing_reason(step, module, act)
            if reason is not None:
                return reason
            packed, bias = module.packed, [] if module.bias is None else [module.bias]
            if bias and bias[0].dtype != self.dtype:
                return f"{step.module}'s bias is not in the model's dtype"
            self.add(step.op, [packed.data, *bias], 0 if packed.quant is None else
                     packed.quant.code, packed.shape[0], act if step.op is Op.GATED
                     else len(bias))
        return None

    def _packing_reason(self, step: Step, module: linear.Linear, act: int) -> str | None:
        packed, name = module.packed, step.module.rsplit(".", 1)[-1]
        fused_gate = step.op is Op.GATED and act == NATIVE_ACTIVATIONS["silu"]
        if step.op is Op.GATED and module.bias is not None:
            return f"{name} has a bias"
        if packed is not None and packed.quant is not None:
            if fused_gate and not linear.fuses_quant_gate(packed):
                return f"{name} is quantized with its up rows inside a panel of 8"
            return None
        want = f"{self.kind}_gated" if fused_gate else self.kind
        if packed is None or packed.layout != want:
            return f"{name} is not packed for the {self.kind} kernel (linear.pack_weight)"
        return None


def _lower(layers: Sequence[nn.Module], shard: Shard, kernels: KernelTable,
           final_norm: nn.Module | None) -> _Program | str:
    """The layers' steps (then `final_norm`'s, where the loop can apply it) lowered for the
    C++ loop, or why these layers cannot run there whatever the batch."""
    if not kernels.layer_loop.kernel:
        return kernels.layer_loop.reason
    if not layers:
        return "no decoder layers on this stage"
    if shard.tp_size > 1:
        return "tensor parallelism (an all-reduce between a layer's kernels)"
    dtype = layers[0].input_layernorm.weight.dtype
    program = _Program("f32" if dtype == torch.float32 else "amx", dtype)
    for i, layer in enumerate(layers):
        for step, module in layer.step_modules:
            reason = program.lower(step, module, i)
            if reason is not None:
                return reason
    if final_norm is not None and program.lower(Step(Op.ADD_NORM, "norm"), final_norm,
                                                len(layers)) is None:
        program.final_norm = final_norm.weight
    if not kernels.matmul_quant.kernel and any(program.ints[2::INTS_PER_STEP]):
        return "some matmuls are quantized and matmul_quant runs in torch"
    program.records = (torch.tensor(program.ints, dtype=torch.int64),
                       torch.tensor(program.floats, dtype=torch.float64))
    return program


@dataclass(frozen=True)
class LayerLoop:
    program: _Program  # the steps as csrc/layer_loop.cpp reads them, and their weights
    kernels: KernelTable  # the model's: it packed the weights, and picks the attention
    layers: int
    heads: int
    kv_heads: int
    head_dim: int  # the cache's rows may be wider (an int8 row ends in its scale)
    # The model's final RMSNorm weight, applied in the same call (the last pipeline stage):
    # at a one-row step its Python call cost ~0.1 ms on cold caches.
    final_norm: torch.Tensor | None = None
    dense_bf16: bool = False  # some matmul weight is in the bf16 tile packing

    @classmethod
    def build(cls, layers: Sequence[nn.Module], shard: Shard, kernels: KernelTable,
              final_norm: nn.Module | None = None) -> tuple[LayerLoop | None, str | None]:
        """(the loop over `layers`, None) once their weights are packed for `kernels`, else
        (None, why). `final_norm`: the RMSNorm after the last layer, if this stage has it."""
        program = _lower(layers, shard, kernels, final_norm)
        if isinstance(program, str):
            return None, program
        attn = layers[0].self_attn
        dense_bf16 = any(m.packed is not None and m.packed.quant is None
                         and m.packed.data.dtype == torch.bfloat16
                         for layer in layers for _, m in layer.step_modules
                         if isinstance(m, linear.Linear))
        return cls(program, kernels, len(layers), attn.num_heads, attn.num_kv_heads,
                   attn.head_dim, program.final_norm, dense_bf16), None

    def fits(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        """Whether this batch takes the C++ loop: each call there is the kernel the Python
        path would choose for it (after `meta.prepare`). The table chose the kernels for
        every op of a layer (`build`); what is left are the batch's own facts."""
        if not (x.device.type == "cpu" and x.dtype == self.program.dtype and x.dim() == 2
                and x.is_contiguous() and self._matmuls_run(x.shape[0])
                and fused.cache_fits_rope(kv_cache, x.dtype) and kv_cache.shape[0] == self.layers):
            return False
        decodes = x.shape[0] > meta.num_prefill_tokens
        if decodes and not paged_decode.usable(kv_cache[0], self.kernels):
            return False
        return ((meta.num_prefill_tokens == 0 or meta.prefill_kernel_lens is not None)
                and self._tiles(x, meta) is not None)

    def _tiles(self, x: torch.Tensor, meta: AttentionMetadata) -> bool | None:
        """Whether the batch's attention takes AMX tiles (one flag for the call's decodes
        and chunks); None where the table asks for tiles in one and not the other."""
        wants = set()
        if meta.num_prefill_tokens:
            wants.add(self.kernels.prefill_attention.impl == "amx")
        if x.shape[0] > meta.num_prefill_tokens:
            wants.add(self.kernels.decode_attention.impl == "amx")
        return None if len(wants) > 1 else bool(wants and wants.pop())

    def _matmuls_run(self, rows: int) -> bool:
        """Whether linear.py would run these packings' matmuls of `rows` rows in the kernel:
        float32 and quantized ones at any row count, bf16 ones where the tile kernel takes
        them."""
        return not self.dense_bf16 or linear.runs_packed(rows, self.kernels)

    def __call__(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                 meta: AttentionMetadata,
                 kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the last layer's output, the residual stream before it), as the Python layers
        return them; with `final_norm`, (the final norm of their sum, the sum). cos/sin
        from RotaryEmbedding.lookup."""
        t, program = x.shape[0], self.program
        prefill = ([meta.prefill_table, *meta.prefill_kernel_lens]
                   if meta.num_prefill_tokens else [])
        return torch.ops.stallfree.decoder_layers(
            x, program.weights, *program.records, kv_cache, cos.reshape(t, -1),
            sin.reshape(t, -1), meta.slot_mapping, meta.decode_block_tables,
            meta.decode_context_lens, prefill, meta.num_prefill_tokens, self.heads,
            self.kv_heads, self.head_dim, self._tiles(x, meta))
