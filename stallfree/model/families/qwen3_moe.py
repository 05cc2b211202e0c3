"""Qwen3-MoE: Qwen3's attention (q/k norms) with sparse MLPs; top-k weights renormalised
only with norm_topk_prob, and dense MLPs in `mlp_only_layers` or off the sparse step."""
from typing import Any

from .base import Family, HFConfig


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


FAMILY = Family(
    name="qwen3_moe",
    hf_architectures=("Qwen3MoeForCausalLM",),
    model_types=("qwen3_moe",),
    hf_extra=_hf_extra,
    hf_layer_names={r"mlp\.gate": "mlp.router"},
)
