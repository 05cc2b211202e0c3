"""Architecture hyper-parameters of a Llama-family decoder, read from HF or GGUF metadata."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ARCHITECTURES = ("llama", "qwen2")

# HF `architectures` entries we can run, mapped to our architecture name.
# Mistral is a Llama with a different name (its sliding window only matters
# beyond the window: `context_limit` keeps sequences within it).
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}

ROPE_TYPES = ("llama3", "linear", "freq_factors")


@dataclass
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # None for plain RoPE. Otherwise a dict with "rope_type" in ROPE_TYPES:
    #   llama3: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    #   linear: factor
    #   freq_factors: factors (one divisor per frequency; how llama.cpp stores llama3 scaling)
    rope_scaling: dict[str, Any] | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    # We attend to the full context, which equals sliding-window attention as long as
    # sequences stay within the window: `context_limit` caps max_model_len at it.
    sliding_window: int | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(
                f"unsupported architecture {self.architecture!r}; expected one of {ARCHITECTURES}")
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)

    @property
    def logits_row_cost(self) -> float:
        """What a token costs with its logits row and their log-softmax relative to one
        without, by multiply-adds: the layers' projections and MLP against the LM head,
        taken at 1.5x for the log-softmax over its output, which measured about half the
        matmul again on CPU (docs/benchmarks.md, "Prompt logprobs"). Prices prompt
        logprobs in the scheduler's token budget."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * self.intermediate_size
        return 1.0 + 1.5 * self.vocab_size * h / (self.num_hidden_layers * per_layer)

    @property
    def context_limit(self) -> int:
        """The longest sequence this engine runs exactly: the position limit, or the
        sliding window when it is shorter (beyond it, full attention would differ from
        the model's windowed attention; we cap rather than mask)."""
        if self.sliding_window and self.sliding_window < self.max_position_embeddings:
            return self.sliding_window
        return self.max_position_embeddings

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.eos_token_id
        if eos is None:
            return frozenset()
        if isinstance(eos, int):
            return frozenset((eos,))
        return frozenset(int(e) for e in eos)

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any]) -> ModelConfig:
        """Build from a parsed Hugging Face `config.json` (transformers 4.x or 5.x layout)."""
        archs = cfg.get("architectures") or []
        known = [HF_ARCHITECTURES[a] for a in archs if a in HF_ARCHITECTURES]
        if not known:
            model_type = cfg.get("model_type")
            if not archs and model_type in ("llama", "mistral", "qwen2"):
                known = ["qwen2" if model_type == "qwen2" else "llama"]
            else:
                raise ValueError(
                    f"unsupported model architecture {archs or model_type!r}; supported: "
                    f"{sorted(HF_ARCHITECTURES)}")
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; "
                             f"only silu is supported")
        if cfg.get("mlp_bias", False):
            raise ValueError("mlp_bias=True is not supported")
        arch = known[0]
        heads = cfg["num_attention_heads"]
        # transformers 5 folds rope_theta and the scaling into `rope_parameters`;
        # 4.x has `rope_theta` plus `rope_scaling`.
        rope_params = dict(cfg.get("rope_parameters") or {})
        rope_theta = rope_params.pop("rope_theta", cfg.get("rope_theta", 10000.0))
        scaling = cfg.get("rope_scaling") or (rope_params or None)
        window = cfg.get("sliding_window")
        if arch == "qwen2" and not cfg.get("use_sliding_window", False):
            window = None
        return cls(
            architecture=arch,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_hidden_layers=cfg["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=cfg.get("num_key_value_heads") or heads,
            head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            # Qwen2 always has q/k/v biases; its config has no flag for it.
            attention_bias=True if arch == "qwen2" else cfg.get("attention_bias", False),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_id=cfg.get("eos_token_id"),
            sliding_window=window,
        )

    @classmethod
    def from_gguf(cls, reader: Any) -> ModelConfig:
        """Build from a `gguf.GGUFReader` (llama.cpp metadata keys)."""
        arch = _field(reader, "general.architecture")
        if arch not in ARCHITECTURES:
            raise ValueError(
                f"unsupported GGUF architecture {arch!r}; supported: {ARCHITECTURES}")

        def key(name: str, default: Any = None) -> Any:
            return _field(reader, f"{arch}.{name}", default)

        tensors = {t.name: t for t in reader.tensors}
        heads = int(key("attention.head_count"))
        hidden = int(key("embedding_length"))
        vocab = key("vocab_size")
        if vocab is None:
            # Not always written; the embedding's row count is authoritative.
            vocab = int(tensors["token_embd.weight"].shape[-1])
        # Chat GGUFs may mark end-of-turn separately from end-of-text; both stop generation.
        stops = [_field(reader, f"tokenizer.ggml.{k}_token_id") for k in ("eos", "eot", "eom")]
        stops = list(dict.fromkeys(int(s) for s in stops if s is not None))
        return cls(
            architecture=arch,
            vocab_size=int(vocab),
            hidden_size=hidden,
            intermediate_size=int(key("feed_forward_length")),
            num_hidden_layers=int(key("block_count")),
            num_attention_heads=heads,
            num_key_value_heads=int(key("attention.head_count_kv", heads)),
            head_dim=int(key("attention.key_length", hidden // heads)),
            rms_norm_eps=float(key("attention.layer_norm_rms_epsilon", 1e-5)),
            rope_theta=float(key("rope.freq_base", 10000.0)),
            rope_scaling=_gguf_rope_scaling(reader, arch, tensors),
            max_position_embeddings=int(key("context_length", 2048)),
            tie_word_embeddings="output.weight" not in tensors,
            attention_bias="blk.0.attn_q.bias" in tensors,
            bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
            eos_token_id=None if not stops else stops[0] if len(stops) == 1 else stops,
        )


def _field(reader: Any, name: str, default: Any = None) -> Any:
    f = reader.fields.get(name)
    if f is None:
        return default
    return f.contents()


def _gguf_rope_scaling(reader: Any, arch: str, tensors: dict[str, Any]) -> dict[str, Any] | None:
    # llama.cpp's converter bakes llama3 scaling into a per-frequency divisor tensor.
    if "rope_freqs.weight" in tensors:
        import numpy as np

        factors = np.asarray(tensors["rope_freqs.weight"].data, dtype=np.float32).reshape(-1)
        return {"rope_type": "freq_factors", "factors": [float(x) for x in factors]}
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return None
    if kind == "linear":
        factor = float(_field(reader, f"{arch}.rope.scaling.factor"))
        return {"rope_type": "linear", "factor": factor}
    raise ValueError(f"unsupported GGUF rope scaling type {kind!r}")


def _normalise_rope_scaling(scaling: dict[str, Any] | None) -> dict[str, Any] | None:
    """Accept both `rope_type` and the older `type` key; reject types we cannot run."""
    if not scaling:
        return None
    scaling = dict(scaling)
    kind = scaling.pop("rope_type", None) or scaling.pop("type", None)
    scaling.pop("type", None)
    if kind in (None, "default"):
        return None
    if kind not in ROPE_TYPES:
        raise ValueError(f"unsupported rope_scaling type {kind!r}; supported: {ROPE_TYPES}")
    scaling["rope_type"] = kind
    return scaling
