"""The decoder's description: the hyper-parameters and layer features of a model, read from
HF or GGUF metadata by its family (families/). The forward pass (decoder.py) reads only
this, never a family's name."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

ACTIVATIONS = ("silu", "gelu_tanh")
ROPE_TYPES = ("llama3", "linear", "freq_factors")


@dataclass
class ModelConfig:
    architecture: str  # the family (families/): how checkpoints name the weights
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
    # The layer's features beyond Llama's. The MLP's activation, gated: act(gate) * up.
    hidden_act: str = "silu"
    qk_norm: bool = False  # an RMSNorm over each q and k head before RoPE (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # RMSNorms on attention's and the MLP's outputs (Gemma)
    embedding_scale: float | None = None  # embeddings multiplied by it (Gemma: sqrt(hidden))
    attention_scale: float | None = None  # None: head_dim ** -0.5
    attn_logit_softcap: float | None = None  # scores -> c * tanh(scores / c) (Gemma 2)
    final_logit_softcap: float | None = None  # the same on the logits
    # Sliding-window attention: a query sees its last `sliding_window` positions, in the
    # layers flagged by window_layers (None: every layer).
    sliding_window: int | None = None
    window_layers: list[bool] | None = None
    local_rope_theta: float | None = None  # windowed layers' RoPE base (Gemma 3), unscaled
    # Mixture of experts: each sparse layer's MLP is num_experts experts of
    # moe_intermediate_size, num_experts_per_tok chosen per token by a softmax router
    # (their weights renormalised to sum 1 with moe_renormalize); dense_layers keep an MLP
    # of intermediate_size.
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_renormalize: bool = True
    dense_layers: list[int] | None = None

    def __post_init__(self) -> None:
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2 != 0:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in ACTIVATIONS:
            raise ValueError(f"unsupported hidden_act {self.hidden_act!r}; supported: "
                             f"{ACTIVATIONS}")
        if self.num_experts and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ValueError(f"num_experts_per_tok must be in [1, {self.num_experts}], got "
                             f"{self.num_experts_per_tok}")
        if self.window_layers is not None and len(self.window_layers) != self.num_hidden_layers:
            raise ValueError(f"window_layers lists {len(self.window_layers)} layers, the "
                             f"model has {self.num_hidden_layers}")
        self.rope_scaling = _normalise_rope_scaling(self.rope_scaling)

    def layer_window(self, layer: int) -> int | None:
        """The sliding window of layer `layer` (global numbering), None for full attention."""
        if not self.sliding_window or self.sliding_window >= self.max_position_embeddings:
            return None
        if self.window_layers is not None and not self.window_layers[layer]:
            return None
        return self.sliding_window

    @property
    def kv_window(self) -> int | None:
        """The window of every layer, where all have one (None otherwise): the KV a request
        must keep is then its last `kv_window` positions."""
        windows = {self.layer_window(i) for i in range(self.num_hidden_layers)}
        return windows.pop() if len(windows) == 1 else None

    def layer_is_sparse(self, layer: int) -> bool:
        """Whether layer `layer`'s MLP is a mixture of experts."""
        return self.num_experts > 0 and layer not in (self.dense_layers or ())

    def layer_features(self) -> list[str]:
        """What this model's layers add to Llama's, in words (`stallfree info`)."""
        windowed = sum(1 for i in range(self.num_hidden_layers) if self.layer_window(i))
        return [text for present, text in (
            (self.hidden_act != "silu", f"{self.hidden_act} MLP"),
            (self.qk_norm, "q/k norms"),
            (self.sandwich_norms, "norms on attention and MLP outputs"),
            (self.attention_scale is not None, "its own attention scale"),
            (bool(self.attn_logit_softcap), "soft-capped attention"),
            (bool(windowed), f"a {self.sliding_window}-token window in {windowed} of "
                             f"{self.num_hidden_layers} layers"),
            (bool(self.num_experts), f"{self.num_experts} experts, top "
                                     f"{self.num_experts_per_tok}"),
        ) if present]

    @property
    def logits_row_cost(self) -> float:
        """What a token costs with its logits row and their log-softmax relative to one
        without, by multiply-adds: the layers' projections and MLP against the LM head,
        taken at 1.5x for the log-softmax over its output, which measured about half the
        matmul again on CPU (docs/benchmarks.md, "Prompt logprobs"). Prices prompt
        logprobs in the scheduler's token budget."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        q = self.num_attention_heads * self.head_dim
        mlp = (self.num_experts_per_tok * self.moe_intermediate_size if self.num_experts
               else self.intermediate_size)  # the experts a token runs
        per_layer = 2 * h * q + 2 * h * kv + 3 * h * mlp
        return 1.0 + 1.5 * self.vocab_size * h / (self.num_hidden_layers * per_layer)

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.eos_token_id
        if eos is None:
            return frozenset()
        if isinstance(eos, int):
            return frozenset((eos,))
        return frozenset(int(e) for e in eos)


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
