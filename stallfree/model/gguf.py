"""GGUF tensors under Hugging Face names, in HF's row order: dequantised lazily, or as quant
rows (quant_formats.py) for the weights that stay quantized.

A mixture of experts' 3-D tensors (blk.N.ffn_{gate,up,down}_exps, [E, rows, cols]) become
each expert's HF matrices (mlp.experts.{e}.gate_proj ...), always dequantized: our experts
are stacked 2-D parameters (moe.SparseMoE), not the linear layers quantized matmuls run."""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from .config import ModelConfig
from .families import family_of
from .quant_formats import from_gguf
from .weights import Fetch, slicer

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
# 3-D expert tensor -> the HF matrix each expert's rows are. (llama.cpp refuses its
# converter's --fuse-gate-up-exps for Mixtral and Qwen3-MoE, so ffn_gate_up_exps is not read.)
_GGUF_EXPERTS = {"ffn_gate_exps": "gate_proj", "ffn_up_exps": "up_proj",
                 "ffn_down_exps": "down_proj"}
_GGUF_EXPERT_BLOCK = re.compile(rf"blk\.(\d+)\.({'|'.join(_GGUF_EXPERTS)})\.weight$")


def _gguf_to_hf_name(name: str, layer_names: dict[str, str]) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name == "rope_freqs.weight":
        return None  # folded into the config's rope scaling
    m = _GGUF_BLOCK.match(name)
    if m is None or m.group(2) not in layer_names:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{layer_names[m.group(2)]}.{m.group(3)}"


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for Q/K of the llama arch.

    The converter interleaves each head's two rotary halves (rows i and i + d/2 become
    rows 2i and 2i+1) for its pairwise RoPE; HF's rotate_half wants them split again.
    """
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return (w.reshape(n_heads, head_dim // 2, 2, *rest)
            .swapaxes(1, 2).reshape(w.shape))


def gguf_named_tensors(tensors, config: ModelConfig) -> Iterator[tuple[str, object]]:
    """(HF name, tensor) per GGUF tensor that is one HF tensor, by the family's GGUF names:
    those that may stay quantized. The expert tensors are not (see gguf_tensors)."""
    layer_names = _GGUF_LAYER_NAMES | family_of(config).gguf_layer_names
    for t in tensors:
        if _GGUF_EXPERT_BLOCK.match(t.name):
            continue
        name = _gguf_to_hf_name(t.name, layer_names)
        if name is not None:
            yield name, t


def gguf_tensors(tensors, config: ModelConfig) -> Iterator[tuple[str, Fetch]]:
    """(HF name, fetch) per tensor (a gguf reader's, or their saved index's), and per
    expert's matrix; a tensor is dequantised only if it is fetched."""
    for name, t in gguf_named_tensors(tensors, config):
        yield name, slicer(lambda t=t, name=name: _gguf_dequantize(t, name, config))
    for t in tensors:
        yield from _expert_tensors(t)


def _expert_tensors(t) -> Iterator[tuple[str, Fetch]]:
    """Each expert's HF matrix in a 3-D expert tensor (none for other tensors).

    The data is [E, rows, cols], or [E, rows, row bytes] of quantized blocks: expert e's
    rows are data[e], contiguous in the file. Each expert's fetch dequantizes just those,
    so the tensor is dequantized once in all, an expert at a time, never whole in float.
    """
    m = _GGUF_EXPERT_BLOCK.match(t.name)
    if m is None:
        return
    part = _GGUF_EXPERTS[m.group(2)]
    for e in range(int(t.shape[-1])):  # GGUF order: [cols, rows, E]
        yield (f"model.layers.{m.group(1)}.mlp.experts.{e}.{part}.weight",
               slicer(lambda e=e: _dequantize(t.data[e], t.tensor_type)))


def gguf_quant_rows(t, name: str, config: ModelConfig) -> torch.Tensor:
    """Tensor `t` (of a type quant_formats keeps) as quant rows [N, row_bytes], in HF's row
    order: its blocks converted, never dequantized."""
    k = int(t.shape[0])  # GGUF lists the fastest dimension, a row's length, first
    rows = from_gguf(t.data, t.tensor_type, k)
    return torch.from_numpy(np.ascontiguousarray(_hf_rows(rows, name, config)))


def _hf_rows(data: np.ndarray, name: str, config: ModelConfig) -> np.ndarray:
    if family_of(config).gguf_rope_rows_permuted:
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            return _unpermute_rope_rows(data, config.num_attention_heads)
        if name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            return _unpermute_rope_rows(data, config.num_key_value_heads)
    return data


def _gguf_dequantize(t, name: str, config: ModelConfig) -> np.ndarray:
    # GGUF lists dims fastest-first; numpy/torch want them reversed.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    return _hf_rows(_dequantize(t.data, t.tensor_type).reshape(shape), name, config)


def _dequantize(data: np.ndarray, tensor_type) -> np.ndarray:
    from gguf.quants import dequantize

    return np.asarray(dequantize(data, tensor_type))
