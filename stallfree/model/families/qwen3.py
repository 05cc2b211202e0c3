"""Qwen3: a Llama with an RMSNorm over each query and key head before RoPE."""

from .base import Family

QK_NORM_GGUF_NAMES = {"attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm"}

FAMILY = Family(
    name="qwen3",
    hf_architectures=("Qwen3ForCausalLM",),
    model_types=("qwen3",),
    hf_extra=lambda raw: {"qk_norm": True},
    gguf_architectures=("qwen3",),
    gguf_extra=lambda key: {"qk_norm": True},
    gguf_layer_names=QK_NORM_GGUF_NAMES,
)
