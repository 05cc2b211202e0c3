"""Mixtral: a Mistral whose MLPs are sparse mixtures of experts (top-k of a softmax over the
router's logits, renormalised to sum 1). llama.cpp writes it as the "llama" GGUF
architecture with experts, Q/K rows interleaved as for Llama."""
from typing import Any

from .base import Family, HFConfig, gguf_moe_fields


def _hf_extra(raw: HFConfig) -> dict[str, Any]:
    return {"num_experts": raw["num_local_experts"], "num_experts_per_tok":
            raw["num_experts_per_tok"], "moe_intermediate_size": raw["intermediate_size"],
            "moe_renormalize": True}


FAMILY = Family(
    name="mixtral",
    hf_architectures=("MixtralForCausalLM",),
    model_types=("mixtral",),
    hf_extra=_hf_extra,
    gguf_architectures=("llama",),
    gguf_extra=gguf_moe_fields,
    hf_layer_names={r"block_sparse_moe\.gate": "mlp.router",
                    **{rf"block_sparse_moe\.experts\.(\d+)\.{w}": rf"mlp.experts.\1.{ours}"
                       for w, ours in (("w1", "gate_proj"), ("w3", "up_proj"),
                                       ("w2", "down_proj"))}},
    gguf_layer_names={"ffn_gate_inp": "block_sparse_moe.gate"},
    gguf_rope_rows_permuted=True,
    gguf_experts=True,
)
