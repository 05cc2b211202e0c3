"""What a model family is: how its checkpoints describe it (HF config.json, GGUF metadata)
and name its weights, mapped onto the one decoder description (config.ModelConfig).

A family module builds one `Family`, listed in the registry (families/__init__.py). Everything a
family changes in the forward pass is a field of ModelConfig, so the decoder (decoder.py)
and the kernel choice read the config, never the family's name.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

HFConfig = dict[str, Any]
# (name, default) -> a GGUF metadata value under the file's architecture prefix.
GGUFKey = Callable[[str, Any], Any]


@dataclass(frozen=True)
class Family:
    name: str  # ModelConfig.architecture
    hf_architectures: tuple[str, ...]  # config.json `architectures` entries
    model_types: tuple[str, ...] = ()  # config.json `model_type`, for files without the above
    # (raw config.json) -> ModelConfig fields beyond `hf_fields`'s, or overrides of them.
    hf_extra: Callable[[HFConfig], dict[str, Any]] = lambda raw: {}
    gguf_architectures: tuple[str, ...] = ()  # GGUF `general.architecture` values
    gguf_extra: Callable[[GGUFKey], dict[str, Any]] = lambda key: {}
    # Checkpoint names inside a layer (regular expressions matching a prefix ending at a
    # ".") -> ours; HF names otherwise map to themselves.
    hf_layer_names: dict[str, str] = field(default_factory=dict)
    # GGUF tensor kinds (blk.N.<kind>.weight) beyond the common ones, or overriding them,
    # -> the family's HF names (which hf_layer_names then renames).
    gguf_layer_names: dict[str, str] = field(default_factory=dict)
    # llama.cpp's converter interleaves Q/K rows for the "llama" architecture only.
    gguf_rope_rows_permuted: bool = False
    # Claims its GGUF architectures only in files with experts (`{arch}.expert_count` > 0),
    # the other families only in files without: llama.cpp writes Mixtral as "llama".
    gguf_experts: bool = False
    # Added to every RMSNorm weight of an HF checkpoint: Gemma stores w for a (1 + w)
    # norm, which llama.cpp's converter already folds into its GGUF files.
    hf_norm_offset: float = 0.0


def hf_rope(raw: HFConfig) -> tuple[float, dict[str, Any] | None]:
    """(rope theta, scaling) from transformers 5's `rope_parameters` or 4.x's
    `rope_theta` + `rope_scaling`."""
    params = dict(raw.get("rope_parameters") or {})
    if "full_attention" in params:  # per layer type (Gemma 3): the global layers' here
        params = dict(params["full_attention"])
    theta = params.pop("rope_theta", raw.get("rope_theta", 10000.0))
    if params.pop("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial rotary embeddings (partial_rotary_factor < 1) are not "
                         "supported")
    return float(theta), raw.get("rope_scaling") or (params or None)


def hf_fields(raw: HFConfig, name: str) -> dict[str, Any]:
    """The fields every family's config.json has, under transformers' common names."""
    if raw.get("mlp_bias", False):
        raise ValueError("mlp_bias=True is not supported")
    heads = raw["num_attention_heads"]
    theta, scaling = hf_rope(raw)
    return dict(
        architecture=name,
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        intermediate_size=raw["intermediate_size"],
        num_hidden_layers=raw["num_hidden_layers"],
        num_attention_heads=heads,
        num_key_value_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or raw["hidden_size"] // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        rope_theta=theta,
        rope_scaling=scaling,
        max_position_embeddings=raw.get("max_position_embeddings", 2048),
        tie_word_embeddings=raw.get("tie_word_embeddings", False),
        attention_bias=raw.get("attention_bias", False),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_id=raw.get("eos_token_id"),
        hidden_act=_activation(raw.get("hidden_activation") or raw.get("hidden_act", "silu")),
        **hf_windows(raw),
    )


def _activation(name: str) -> str:
    if name == "silu":
        return "silu"
    if name in ("gelu_pytorch_tanh", "gelu_tanh"):
        return "gelu_tanh"
    raise ValueError(f"unsupported hidden activation {name!r}; supported: silu, "
                     f"gelu_pytorch_tanh")


def hf_windows(raw: HFConfig,
               default_pattern: Callable[[int], bool] | None = None) -> dict[str, Any]:
    """sliding_window and window_layers: transformers 5 lists `layer_types`; older files
    say only `sliding_window` (every layer), or the family's pattern decides."""
    window = raw.get("sliding_window")
    if not window or raw.get("use_sliding_window") is False:
        return {"sliding_window": None, "window_layers": None}
    layers = raw["num_hidden_layers"]
    types = raw.get("layer_types")
    if types:
        flags = [t == "sliding_attention" for t in types]
    elif default_pattern is not None:
        flags = [default_pattern(i) for i in range(layers)]
    else:
        flags = [True] * layers
    if not any(flags):
        return {"sliding_window": None, "window_layers": None}
    return {"sliding_window": int(window), "window_layers": None if all(flags) else flags}


def gguf_window_fields(key: GGUFKey, pattern: Callable[[int], bool] | None) -> dict[str, Any]:
    """sliding_window and window_layers from GGUF metadata (`attention.sliding_window`);
    which layers use it is the family's fixed pattern (llama.cpp hard-codes it too)."""
    window = key("attention.sliding_window", None)
    if not window:
        return {}
    if pattern is None:
        return {"sliding_window": int(window)}
    flags = [pattern(i) for i in range(int(key("block_count", 0)))]
    return {"sliding_window": int(window), "window_layers": None if all(flags) else flags}


def gguf_moe_fields(key: GGUFKey) -> dict[str, Any]:
    """The experts of a GGUF file (llama.cpp's keys). llama.cpp renormalises the top-k
    weights of its Mixtral ("llama") and Qwen3-MoE graphs whatever the HF config said (their
    converters write no `expert_weights_norm`), so that is the default."""
    gating = key("expert_gating_func", None)
    if gating not in (None, 1):  # gguf.ExpertGatingFuncType.SOFTMAX
        raise ValueError(f"unsupported GGUF expert gating function {gating!r}: only a "
                         f"softmax router is supported")
    return {"num_experts": int(key("expert_count", 0)),
            "num_experts_per_tok": int(key("expert_used_count", 0)),
            # Mixtral's files give the experts' size as the model's feed_forward_length.
            "moe_intermediate_size": int(key("expert_feed_forward_length", None)
                                         or key("feed_forward_length", 0)),
            "moe_renormalize": bool(key("expert_weights_norm", True))}
