"""Qwen2 and Qwen2.5: a Llama with q/k/v biases (always: its config has no flag for them)."""
from typing import Any

from .base import Family, HFConfig, hf_windows


def _hf_extra(raw: HFConfig) -> dict[str, Any]:
    # Older configs say use_sliding_window and max_window_layers instead of layer_types.
    first = raw.get("max_window_layers", raw["num_hidden_layers"])
    return {"attention_bias": True, **hf_windows(raw, lambda i: i >= first)}


FAMILY = Family(
    name="qwen2",
    hf_architectures=("Qwen2ForCausalLM",),
    model_types=("qwen2",),
    hf_extra=_hf_extra,
    gguf_architectures=("qwen2",),
)
