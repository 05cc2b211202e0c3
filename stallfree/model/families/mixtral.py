"""Mixtral: a Mistral whose MLPs are sparse mixtures of experts (top-k of a softmax over the
router's logits, renormalised to sum 1)."""
from typing import Any

from .base import Family, HFConfig


def _hf_extra(raw: HFConfig) -> dict[str, Any]:
    return {"num_experts": raw["num_local_experts"], "num_experts_per_tok":
            raw["num_experts_per_tok"], "moe_intermediate_size": raw["intermediate_size"],
            "moe_renormalize": True}


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    hf_extra=_hf_extra,
    hf_layer_names={r"block_sparse_moe\.gate": "mlp.router",
                    **{rf"block_sparse_moe\.experts\.(\d+)\.{w}": rf"mlp.experts.\1.{ours}"
                       for w, ours in (("w1", "gate_proj"), ("w3", "up_proj"),
                                       ("w2", "down_proj"))}},
)
