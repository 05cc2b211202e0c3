"""The model registry: each family is a small module defining a `Family` (base.py), listed
below.

Adding a dense Llama-like family is one module here (its config mapping and weight names)
and one test; what it changes in the forward pass must already be a field of ModelConfig.
"""
from __future__ import annotations

from typing import Any

from ..config import ModelConfig
from . import gemma, llama, mistral, mixtral, phi3, qwen2, qwen3, qwen3_moe
from .base import Family, GGUFKey, hf_fields

FAMILIES: dict[str, Family] = {f.name: f for f in (
    llama.FAMILY, mistral.FAMILY, qwen2.FAMILY, qwen3.FAMILY, phi3.FAMILY, gemma.GEMMA2,
    gemma.GEMMA3, mixtral.FAMILY, qwen3_moe.FAMILY)}


def family_of(config: ModelConfig) -> Family:
    try:
        return FAMILIES[config.architecture]
    except KeyError:
        raise ValueError(f"unsupported architecture {config.architecture!r}; supported: "
                         f"{sorted(FAMILIES)}") from None


def supported_hf_architectures() -> list[str]:
    return sorted(a for f in FAMILIES.values() for a in f.hf_architectures)


def config_from_hf(raw: dict[str, Any]) -> ModelConfig:
    """The decoder description of a parsed Hugging Face `config.json` (transformers 4.x or
    5.x layout)."""
    archs = raw.get("architectures") or []
    family = next((f for a in archs for f in FAMILIES.values() if a in f.hf_architectures),
                  None)
    if family is None and not archs:
        family = next((f for f in FAMILIES.values()
                       if raw.get("model_type") in f.model_types), None)
    if family is None:
        raise ValueError(f"unsupported model architecture {archs or raw.get('model_type')!r}; "
                         f"supported: {supported_hf_architectures()}")
    return ModelConfig(**(hf_fields(raw, family.name) | family.hf_extra(raw)))


def config_from_gguf(reader: Any) -> ModelConfig:
    """The decoder description of a `gguf.GGUFReader`'s metadata (llama.cpp's keys)."""
    arch = gguf_field(reader, "general.architecture")
    experts = bool(gguf_field(reader, f"{arch}.expert_count", 0))
    family = next((f for f in FAMILIES.values()
                   if arch in f.gguf_architectures and f.gguf_experts == experts), None)
    if family is None:
        known = sorted({a for f in FAMILIES.values() for a in f.gguf_architectures})
        raise ValueError(f"unsupported GGUF architecture {arch!r}"
                         f"{' with experts' if experts else ''}; supported: {known}")

    def key(name: str, default: Any = None) -> Any:
        return gguf_field(reader, f"{arch}.{name}", default)

    tensors = {t.name: t for t in reader.tensors}
    heads = int(key("attention.head_count"))
    hidden = int(key("embedding_length"))
    head_dim = int(key("attention.key_length", hidden // heads))
    rotary = key("rope.dimension_count", None)
    if rotary is not None and int(rotary) != head_dim:
        raise ValueError(f"partial rotary embeddings ({rotary} of {head_dim} dims rotated) "
                         f"are not supported")
    vocab = key("vocab_size")
    if vocab is None:  # not always written; the embedding's row count is authoritative
        vocab = int(tensors["token_embd.weight"].shape[-1])
    # Chat GGUFs may mark end-of-turn separately from end-of-text; both stop generation.
    stops = [gguf_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
    stops = list(dict.fromkeys(int(s) for s in stops if s is not None))
    fields = dict(
        architecture=family.name,
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(key("feed_forward_length")),
        num_hidden_layers=int(key("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(key("attention.head_count_kv", heads)),
        head_dim=head_dim,
        rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
        rope_theta=float(key("rope.freq_base", 10000.0)),
        rope_scaling=_gguf_rope_scaling(reader, arch, tensors),
        max_position_embeddings=int(key("context_length", 2048)),
        tie_word_embeddings="output.weight" not in tensors,
        attention_bias="blk.0.attn_q.bias" in tensors,
        bos_token_id=gguf_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=None if not stops else stops[0] if len(stops) == 1 else stops,
    )
    return ModelConfig(**(fields | family.gguf_extra(key)))


def gguf_field(reader: Any, name: str, default: Any = None) -> Any:
    f = reader.fields.get(name)
    if f is None:
        return default
    return f.contents()


def _gguf_rope_scaling(reader: Any, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    if "rope_factors_long.weight" in tensors or "rope_factors_short.weight" in tensors:
        raise ValueError("LongRoPE scaling (rope_factors_long/short, Phi-3's 128k models) is "
                         "not supported")
    # llama.cpp's converter bakes llama3 scaling into a per-frequency divisor tensor.
    if "rope_freqs.weight" in tensors:
        import numpy as np

        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = float(gguf_field(reader, f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


__all__ = ["FAMILIES", "Family", "GGUFKey", "config_from_gguf", "config_from_hf", "family_of",
           "supported_hf_architectures"]
