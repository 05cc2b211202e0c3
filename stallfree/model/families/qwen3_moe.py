"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse MLPs; top-k weights renormalised
only with norm_topk_prob, and dense MLPs in `mlp_only_layers` or off the sparse step.

llama.cpp's converter writes neither norm_topk_prob (its graph always renormalises, as
every released Qwen3-MoE sets) nor dense layers (it refuses to convert a model with them),
so a GGUF file's layers are all sparse."""
from typing import Any

from .base import Family, GGUFKey, HFConfig, gguf_moe_fields
from .qwen3 import QK_NORM_GGUF_NAMES


def _hf_extra(raw: HFConfig) -> dict[str, Any]:
    layers, step = raw["num_hidden_layers"], raw.get("decoder_sparse_step", 1)
    only = set(raw.get("mlp_only_layers") or [])
    dense = [i for i in range(layers) if i in only or (i + 1) % step != 0]
    # Released config.json files say num_experts; transformers 5 writes num_local_experts.
    experts = raw.get("num_experts") or raw["num_local_experts"]
    return {"qk_norm": True, "num_experts": experts,
            "num_experts_per_tok": raw["num_experts_per_tok"],
            "moe_intermediate_size": raw["moe_intermediate_size"],
            "moe_renormalize": bool(raw.get("norm_topk_prob", False)), "dense_layers": dense}


def _gguf_extra(key: GGUFKey) -> dict[str, Any]:
    return {"qk_norm": True, **gguf_moe_fields(key)}


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    hf_extra=_hf_extra,
    gguf_architectures=("qwen3moe",),
    gguf_extra=_gguf_extra,
    hf_layer_names={r"mlp\.gate": "mlp.router"},
    gguf_layer_names={"ffn_gate_inp": "mlp.gate", **QK_NORM_GGUF_NAMES},
    gguf_experts=True,
)
