"""A forward pass's decoder layers in one call to the CPU kernels (csrc/layer_loop.cpp).

Where every step of a layer runs in a kernel anyway (bf16 weights in the tile packing of
linear.py or float32 ones in its f32 packing, the fused norms and RoPE of layers.py, paged
attention in its kernels), the Python between those calls is all that is left to save: at
a one-row decode step it cost a fifth of the step (docs/benchmarks.md, "The layer loop in
C++"). The C++ loop calls the same kernels in the same order, so its results are the Python
path's to the bit; the tests hold it to that. Anything else (tensor parallelism, biases,
other dtypes, the kernel table's layer_loop or another op on its reference path, a batch a
kernel does not take) takes the Python loop, which stays the reference.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from . import layers as fused
from . import linear, paged_decode
from .attention import AttentionMetadata
from .config import ModelConfig
from .kernel_table import KernelTable
from .parallel import Shard

WEIGHTS_PER_LAYER = 6  # csrc/layer_loop.cpp's kWeightsPerLayer


def _linears(layer: nn.Module) -> dict[str, linear.Linear]:
    attn, mlp = layer.self_attn, layer.mlp
    return {"qkv_proj": attn.qkv_proj, "o_proj": attn.o_proj, "gate_up_proj": mlp.gate_up_proj,
            "down_proj": mlp.down_proj}


def _unfit_reason(layers: Sequence[nn.Module], shard: Shard, kernels: KernelTable,
                  config: ModelConfig | None) -> str | None:
    """Why these layers cannot run in the C++ loop whatever the batch (None: they can)."""
    if not kernels.layer_loop.kernel:
        return kernels.layer_loop.reason
    if not layers:
        return "no decoder layers on this stage"
    if config is not None and not config.plain_llama_layers:
        return (f"the {config.architecture} layers have features beyond Llama's (the loop "
                f"runs Llama's layer)")
    if shard.tp_size > 1:
        return "tensor parallelism (an all-reduce between a layer's kernels)"
    eps = {norm.eps for layer in layers
           for norm in (layer.input_layernorm, layer.post_attention_layernorm)}
    if len(eps) > 1:
        return "the layers' norms differ in eps"
    kind = "f32" if layers[0].input_layernorm.weight.dtype == torch.float32 else "amx"
    for layer in layers:
        for name, module in _linears(layer).items():
            want = f"{kind}_gated" if name == "gate_up_proj" else kind
            if module.bias is not None:
                return f"{name} has a bias"
            if module.packed is not None and module.packed.quant is not None:
                if not kernels.matmul_quant.kernel:
                    return f"{name} is quantized and matmul_quant runs in torch"
                if name == "gate_up_proj" and not linear.fuses_quant_gate(module.packed):
                    return "gate/up is quantized with its up rows inside a panel of 8"
            elif module.packed is None or module.packed.layout != want:
                return f"{name} is not packed for the {kind} kernel (linear.pack_weight)"
    return None


def _quant_code(module: linear.Linear) -> int:
    """The module's quant format code (csrc/quant_linear.cpp's), 0 for a float packing."""
    quant = module.packed.quant
    return 0 if quant is None else quant.code


@dataclass(frozen=True)
class LayerLoop:
    weights: list[torch.Tensor]  # per layer: norm, qkv, o, norm, gate/up, down (packed)
    quant_formats: list[int]  # per layer: qkv, o, gate/up, down's quant format code, or 0
    kernels: KernelTable  # the model's: it packed the weights, and picks the attention
    heads: int
    kv_heads: int
    head_dim: int  # the cache's rows may be wider (an int8 row ends in its scale)
    gate_up_features: int
    eps: float
    scale: float
    # The model's final RMSNorm weight, applied in the same call (the last pipeline stage,
    # its eps the layers'): at a one-row step its Python call cost ~0.1 ms on cold caches.
    final_norm: torch.Tensor | None = None
    dense_bf16: bool = False  # some matmul weight is in the bf16 tile packing

    @classmethod
    def build(cls, layers: Sequence[nn.Module], shard: Shard, kernels: KernelTable,
              final_norm: nn.Module | None = None, config: ModelConfig | None = None
              ) -> tuple[LayerLoop | None, str | None]:
        """(the loop over `layers`, None) once their weights are packed for `kernels`, else
        (None, why). `final_norm`: the RMSNorm after the last layer, if this stage has it;
        `config`: the model's description, whose layers must be Llama's."""
        reason = _unfit_reason(layers, shard, kernels, config)
        if reason is not None:
            return None, reason
        weights, quant_formats = [], []
        for layer in layers:
            mods = _linears(layer)
            weights += [layer.input_layernorm.weight, mods["qkv_proj"].packed.data,
                        mods["o_proj"].packed.data, layer.post_attention_layernorm.weight,
                        mods["gate_up_proj"].packed.data, mods["down_proj"].packed.data]
            quant_formats += [_quant_code(m) for m in mods.values()]
        attn, eps = layers[0].self_attn, layers[0].input_layernorm.eps
        norm = (final_norm.weight if final_norm is not None and final_norm.eps == eps
                and final_norm.weight.dtype == layers[0].input_layernorm.weight.dtype
                else None)
        if not any(quant_formats):
            quant_formats = []
        dense_bf16 = any(w.dtype == torch.bfloat16 for i, w in enumerate(weights)
                         if i % WEIGHTS_PER_LAYER not in (0, 3))  # not the norms
        return cls(weights, quant_formats, kernels, attn.num_heads, attn.num_kv_heads,
                   attn.head_dim,
                   layers[0].mlp.gate_up_proj.out_features, eps, attn.scale, norm,
                   dense_bf16), None

    def fits(self, x: torch.Tensor, meta: AttentionMetadata, kv_cache: torch.Tensor) -> bool:
        """Whether this batch takes the C++ loop: each call there is the kernel the Python
        path would choose for it (after `meta.prepare`). The table chose the kernels for
        every op of a layer (`build`); what is left are the batch's own facts."""
        if not (x.device.type == "cpu" and x.dtype == self.weights[0].dtype and x.dim() == 2
                and x.is_contiguous() and self._matmuls_run(x.shape[0])
                and fused.cache_fits_rope(kv_cache, x.dtype)
                and kv_cache.shape[0] * WEIGHTS_PER_LAYER == len(self.weights)):
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
        """(the last layer's MLP output, the residual stream before it), as the Python loop
        of CausalLM.forward returns them; with `final_norm`, (the final norm of
        their sum, the sum). cos/sin from RotaryEmbedding.lookup."""
        t = x.shape[0]
        prefill = ([meta.prefill_table, *meta.prefill_kernel_lens]
                   if meta.num_prefill_tokens else [])
        return torch.ops.stallfree.decoder_layers(
            x, self.weights, kv_cache, cos.reshape(t, -1), sin.reshape(t, -1),
            meta.slot_mapping, meta.decode_block_tables, meta.decode_context_lens, prefill,
            meta.num_prefill_tokens, self.heads, self.kv_heads, self.head_dim,
            self.gate_up_features,
            self.eps, self.scale, self._tiles(x, meta), self.final_norm, self.quant_formats)
