"""Gemma 2 and Gemma 3 (text): GeGLU, (1 + w) RMSNorms around both attention and MLP,
embeddings scaled by sqrt(hidden), query_pre_attn_scalar, local (sliding-window) layers
alternating with global ones; Gemma 2 soft-caps attention and final logits, Gemma 3 norms
q and k per head and gives its local layers their own RoPE base."""
from typing import Any

from .base import Family, GGUFKey, HFConfig, gguf_window_fields, hf_windows
from .qwen3 import QK_NORM_GGUF_NAMES

# Our layer's norms: input_layernorm and post_attention_layernorm (before the MLP) as in
# every family, plus the outputs' norms Gemma adds.
HF_NORMS = {"post_attention_layernorm": "attn_output_norm",
            "pre_feedforward_layernorm": "post_attention_layernorm",
            "post_feedforward_layernorm": "mlp_output_norm"}
# GGUF names map to the checkpoint's (HF_NORMS then renames both alike).
GGUF_NORMS = {"post_attention_norm": "post_attention_layernorm",
              "ffn_norm": "pre_feedforward_layernorm",
              "post_ffw_norm": "post_feedforward_layernorm"}


def _gemma2_local(i: int) -> bool:
    return i % 2 == 0


def _gemma3_local(pattern: int):
    return lambda i: (i + 1) % pattern != 0


def _common(raw: HFConfig, local) -> dict[str, Any]:
    return {"sandwich_norms": True, "embedding_scale": raw["hidden_size"] ** 0.5,
            "attention_scale": raw.get("query_pre_attn_scalar", raw.get("head_dim", 256)) ** -0.5,
            "attn_logit_softcap": raw.get("attn_logit_softcapping"),
            "final_logit_softcap": raw.get("final_logit_softcapping"),
            **hf_windows(raw, local)}


def _gemma2_hf(raw: HFConfig) -> dict[str, Any]:
    return _common(raw, _gemma2_local)


def _gemma3_hf(raw: HFConfig) -> dict[str, Any]:
    params = raw.get("rope_parameters") or {}
    local = params.get("sliding_attention", {}).get("rope_theta",
                                                    raw.get("rope_local_base_freq", 10000.0))
    pattern = raw.get("_sliding_window_pattern") or raw.get("sliding_window_pattern") or 6
    return {**_common(raw, _gemma3_local(pattern)), "qk_norm": True,
            "local_rope_theta": float(local)}


def _gguf_common(key: GGUFKey, local) -> dict[str, Any]:
    hidden = int(key("embedding_length", 0))
    return {"sandwich_norms": True, "embedding_scale": hidden ** 0.5, "hidden_act": "gelu_tanh",
            **gguf_window_fields(key, local)}


def _gemma2_gguf(key: GGUFKey) -> dict[str, Any]:
    return {**_gguf_common(key, _gemma2_local),
            "attn_logit_softcap": key("attn_logit_softcapping", None),
            "final_logit_softcap": key("final_logit_softcapping", None)}


def _gemma3_gguf(key: GGUFKey) -> dict[str, Any]:
    # llama.cpp fixes Gemma 3's pattern: every 6th layer global.
    return {**_gguf_common(key, _gemma3_local(6)), "qk_norm": True,
            "local_rope_theta": float(key("rope.freq_base_swa", 10000.0))}


GEMMA2 = Family(
    name="gemma2",
    hf_architectures=("Gemma2ForCausalLM",),
    model_types=("gemma2",),
    hf_extra=_gemma2_hf,
    gguf_architectures=("gemma2",),
    gguf_extra=_gemma2_gguf,
    hf_layer_names=HF_NORMS,
    gguf_layer_names=GGUF_NORMS,
    hf_norm_offset=1.0,
)

GEMMA3 = Family(
    name="gemma3",
    hf_architectures=("Gemma3ForCausalLM",),
    model_types=("gemma3_text",),
    hf_extra=_gemma3_hf,
    gguf_architectures=("gemma3",),
    gguf_extra=_gemma3_gguf,
    hf_layer_names=HF_NORMS,
    gguf_layer_names={**GGUF_NORMS, **QK_NORM_GGUF_NAMES},
    hf_norm_offset=1.0,
)
