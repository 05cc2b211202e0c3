"""What the simulator knows about models and accelerators: shapes, sizes and datasheet peaks.

Model shapes are copied by hand from each model's public Hugging Face
`config.json` (URL per entry); any other `config.json` can be read with
`ModelSpec.from_hf_config`. GPU peaks are NVIDIA datasheet figures (dense
BF16 tensor throughput, no sparsity) for the variant named in `GpuSpec.name`.
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from typing import Any

GiB = 1 << 30


@dataclass(frozen=True)
class ModelSpec:
    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    gated_mlp: bool = True  # SwiGLU (3 matrices) vs a plain 2-matrix MLP (Falcon)
    parallel_attn: bool = False  # attention and MLP from one input: one all-reduce a layer
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 4096
    profile_name: str | None = None  # HF id under profiles/<gpu>/compute/, if profiled
    source: str = ""
    # Mixture of experts (0 for a dense model): every layer's MLP is `num_experts` experts
    # of `expert_intermediate_size` (0: intermediate_size, Mixtral's convention), of which
    # a router picks `experts_per_token` for each token.
    num_experts: int = 0
    experts_per_token: int = 0
    expert_intermediate_size: int = 0

    @property
    def allreduces_per_layer(self) -> int:
        return 1 if self.parallel_attn else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def mlp_intermediate_size(self) -> int:
        """Width of one MLP (one expert's for MoE)."""
        if self.is_moe and self.expert_intermediate_size:
            return self.expert_intermediate_size
        return self.intermediate_size

    @property
    def active_intermediate_size(self) -> int:
        """MLP width one token goes through: k experts' for MoE (activation memory)."""
        return self.mlp_intermediate_size * (self.experts_per_token if self.is_moe else 1)

    def experts_read(self, tokens: float) -> float:
        """Expected number of distinct experts `tokens` tokens route to, in one layer.

        Assumes uniform routing, independent across tokens: a token's k picks include a
        given expert with probability k/E, so E (1 - (1 - k/E)^T) experts are hit. One
        token reads k experts' weights, a few dozen nearly all E (Mixtral, E = 8, k = 2:
        7.2 at T = 8, 7.9 at T = 16). Real routers are skewed, which hits fewer distinct
        experts: this errs towards reading more weights. 0 for a dense model.
        """
        if not self.is_moe:
            return 0.0
        e, k = self.num_experts, self.experts_per_token
        return e * (1.0 - (1.0 - k / e) ** tokens)

    # ---- sizes (whole model, unsharded) -------------------------------------------------
    def _attn_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        return h * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * h

    def _mlp_params(self, experts: int) -> int:
        """One layer's MLP with `experts` experts (ignored when dense), router included."""
        one = (3 if self.gated_mlp else 2) * self.hidden_size * self.mlp_intermediate_size
        if not self.is_moe:
            return one
        return experts * one + self.hidden_size * self.num_experts  # + the router

    def layer_params(self) -> int:
        """Every weight of one layer (all experts: what memory holds)."""
        return self._attn_params() + self._mlp_params(self.num_experts) + 2 * self.hidden_size

    def active_layer_params(self) -> int:
        """The weights one token of one layer multiplies with (k experts for MoE)."""
        return self._attn_params() + self._mlp_params(self.experts_per_token) \
            + 2 * self.hidden_size

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def _ends_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.embedding_params() + head

    def num_params(self) -> int:
        """Total parameters (all experts)."""
        return self.num_layers * self.layer_params() + self._ends_params()

    def num_active_params(self) -> int:
        """Parameters a token uses (k experts a layer); num_params for a dense model."""
        return self.num_layers * self.active_layer_params() + self._ends_params()

    def kv_heads_per_rank(self, tp: int) -> int:
        # With fewer KV heads than ranks, each rank keeps a replica of one head (vLLM's rule).
        return max(1, self.num_kv_heads // tp)

    def kv_bytes_per_token(self, tp: int, pp: int, dtype_bytes: int = 2) -> int:
        """KV cache bytes one token takes on one rank (its stage's layers, its heads)."""
        layers = math.ceil(self.num_layers / pp)
        return 2 * layers * self.kv_heads_per_rank(tp) * self.head_dim * dtype_bytes

    def weight_bytes_per_rank(self, tp: int, pp: int, dtype_bytes: int = 2) -> int:
        """Weights on the busiest rank: its stage's layers plus the embedding or LM head."""
        layers = math.ceil(self.num_layers / pp) * self.layer_params()
        ends = self.embedding_params() * (1 if pp > 1 or self.tie_word_embeddings else 2)
        return (layers + ends) * dtype_bytes // tp

    @classmethod
    def from_hf_config(cls, cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
        """Reads Llama/Mistral/Qwen2/Yi/Falcon-style key names (the first one present wins)."""
        def get(*keys: str, default: Any = None) -> Any:
            for k in keys:
                if cfg.get(k) is not None:
                    return cfg[k]
            if default is None:
                raise ValueError(f"config.json has none of {', '.join(keys)}")
            return default

        hidden = int(get("hidden_size", "n_embd", "d_model"))
        heads = int(get("num_attention_heads", "n_head", "num_heads"))
        kv = get("num_key_value_heads", "num_kv_heads", "n_head_kv", default=-1)
        if kv == -1:
            kv = 1 if cfg.get("multi_query") else heads
        model_type = str(cfg.get("model_type", ""))
        falcon = model_type in ("falcon", "RefinedWeb", "RefinedWebModel")
        # MoE: Mixtral's num_local_experts (its experts are intermediate_size wide) or
        # Qwen3-MoE's num_experts with moe_intermediate_size.
        experts = int(get("num_local_experts", "num_experts", default=0))
        return cls(
            name=name, num_layers=int(get("num_hidden_layers", "n_layer", "num_layers")),
            hidden_size=hidden,
            intermediate_size=int(get("intermediate_size", "ffn_hidden_size", "n_inner",
                                      default=4 * hidden)),
            num_heads=heads, num_kv_heads=int(kv),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            vocab_size=int(get("vocab_size")),
            gated_mlp=not falcon and cfg.get("hidden_act", "silu") in ("silu", "swiglu"),
            parallel_attn=bool(cfg.get("parallel_attn", False)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            max_position_embeddings=int(get("max_position_embeddings", "max_seq_len",
                                             default=2048)),
            num_experts=experts,
            experts_per_token=int(get("num_experts_per_tok", default=0)) if experts else 0,
            expert_intermediate_size=int(get("moe_intermediate_size", default=0))
            if experts else 0,
            source="config.json")


_HF = "https://huggingface.co/{}/blob/main/config.json"

MODELS: dict[str, ModelSpec] = {m.name: m for m in (
    ModelSpec("llama-2-7b", 32, 4096, 11008, 32, 32, 128, 32000, max_position_embeddings=4096,
              profile_name="meta-llama/Llama-2-7b-hf",
              source=_HF.format("meta-llama/Llama-2-7b-hf")),
    # Mistral-7B has Llama-3-8B's layer shapes (only the vocabulary differs): that profile fits.
    ModelSpec("mistral-7b", 32, 4096, 14336, 32, 8, 128, 32000, max_position_embeddings=32768,
              profile_name="meta-llama/Meta-Llama-3-8B",
              source=_HF.format("mistralai/Mistral-7B-Instruct-v0.2")),
    ModelSpec("llama-3-8b", 32, 4096, 14336, 32, 8, 128, 128256, max_position_embeddings=8192,
              profile_name="meta-llama/Meta-Llama-3-8B",
              source=_HF.format("meta-llama/Meta-Llama-3-8B")),
    # The paper's Yi-34B is the 200K-context variant (same shapes as Yi-34B).
    ModelSpec("yi-34b", 60, 7168, 20480, 56, 8, 128, 64000, max_position_embeddings=200000,
              source=_HF.format("01-ai/Yi-34B-200K")),
    ModelSpec("codellama-34b", 48, 8192, 22016, 64, 8, 128, 32000, max_position_embeddings=16384,
              profile_name="codellama/CodeLlama-34b-Instruct-hf",
              source=_HF.format("codellama/CodeLlama-34b-Instruct-hf")),
    ModelSpec("llama-2-70b", 80, 8192, 28672, 64, 8, 128, 32000, max_position_embeddings=4096,
              profile_name="meta-llama/Llama-2-70b-hf",
              source=_HF.format("meta-llama/Llama-2-70b-hf")),
    # Falcon-180B: new decoder architecture, parallel attention + MLP, GELU MLP of 4x hidden.
    ModelSpec("falcon-180b", 80, 14848, 4 * 14848, 232, 8, 64, 65024, gated_mlp=False,
              parallel_attn=True, max_position_embeddings=2048,
              source=_HF.format("tiiuae/falcon-180B")),
    # Mixtral-8x7B: Mistral-7B's attention, each MLP 8 experts of Mistral-7B's size, 2 a
    # token. No profile: its linear ops use the roofline (cost_model.py).
    ModelSpec("mixtral-8x7b", 32, 4096, 14336, 32, 8, 128, 32000, max_position_embeddings=32768,
              num_experts=8, experts_per_token=2,
              source=_HF.format("mistralai/Mixtral-8x7B-v0.1")),
    # The engine's default model, for `stallfree profile` on this machine.
    ModelSpec("smollm2-135m", 30, 576, 1536, 9, 3, 64, 49152, tie_word_embeddings=True,
              max_position_embeddings=8192, profile_name="HuggingFaceTB/SmolLM2-135M-Instruct",
              source=_HF.format("HuggingFaceTB/SmolLM2-135M-Instruct")),
)}


def get_model(name_or_path: str) -> ModelSpec:
    """A known model name, or a path to a Hugging Face config.json (or its directory)."""
    if name_or_path in MODELS:
        return MODELS[name_or_path]
    path = name_or_path
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    if not os.path.isfile(path):
        raise ValueError(f"unknown model {name_or_path!r}: give one of {', '.join(MODELS)} "
                         f"or a path to a Hugging Face config.json")
    with open(path) as f:
        return ModelSpec.from_hf_config(json.load(f), name=os.path.basename(os.path.dirname(
            os.path.abspath(path))) or "custom")


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_bytes: int
    peak_flops: float  # dense BF16 tensor FLOP/s
    mem_bandwidth: float  # bytes/s
    link_bandwidth: float  # bytes/s one way between two GPUs (roofline all-reduce fallback)
    default_node: str | None  # network profile folder under profiles/<gpu>/network/
    source: str = ""


GPUS: dict[str, GpuSpec] = {g.name: g for g in (
    # A100 80GB PCIe (the paper's Azure NC96ads v4 nodes): 312 TFLOPS BF16, 1,935 GB/s HBM2e;
    # NVLink bridge 600 GB/s total, i.e. 300 GB/s each way.
    GpuSpec("a100", 80 * GiB, 312e12, 1935e9, 300e9, "a100_pairwise_nvlink",
            "https://www.nvidia.com/content/dam/en-zz/Solutions/Data-Center/a100/pdf/"
            "nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf"),
    # H100 SXM5 80GB: 989 TFLOPS BF16 dense, 3.35 TB/s HBM3, NVLink 900 GB/s total.
    GpuSpec("h100", 80 * GiB, 989e12, 3.35e12, 450e9, "h100_pairwise_nvlink",
            "https://resources.nvidia.com/en-us-tensor-core/nvidia-tensor-core-gpu-datasheet"),
    # A40 48GB GDDR6: 149.7 TFLOPS BF16 dense, 696 GB/s, NVLink bridge 112.5 GB/s total.
    GpuSpec("a40", 48 * GiB, 149.7e12, 696e9, 56e9, "a40_pairwise_nvlink",
            "https://images.nvidia.com/content/Solutions/data-center/a40/"
            "nvidia-a40-datasheet.pdf"),
)}

# A device with no datasheet (this machine's CPU): only measured profiles can predict it.
# The roofline fallback uses these placeholders and says so.
CPU = GpuSpec("cpu", 1 * GiB, 1e12, 20e9, 10e9, None, "measured with `stallfree profile`")


def get_gpu(name: str) -> GpuSpec:
    if name == "cpu":
        return CPU
    try:
        return GPUS[name]
    except KeyError:
        raise ValueError(f"unknown gpu {name!r}; known: {', '.join(GPUS)}, cpu") from None


def kv_cache_blocks(model: ModelSpec, gpu: GpuSpec, tp: int, pp: int, block_size: int,
                    gpu_memory_utilization: float = 0.9, max_batched_tokens: int = 8192,
                    kv_cache_memory: int | None = None, dtype_bytes: int = 2) -> int:
    """KV blocks per rank: memory share left after weights and a peak-activation reserve.

    The reserve follows what vLLM measures by a dummy forward: the largest
    batch's activations (residual, QKV, MLP intermediate, per rank) plus
    logits, in the model dtype. `kv_cache_memory` overrides the whole budget
    (as the engine's flag does on CPU).
    """
    if kv_cache_memory is None:
        h = model.hidden_size
        i = model.active_intermediate_size * (2 if model.gated_mlp else 1)
        qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
        act = max_batched_tokens * (4 * h + (qkv + i) // tp) * dtype_bytes
        kv_cache_memory = int(gpu.memory_bytes * gpu_memory_utilization) \
            - model.weight_bytes_per_rank(tp, pp, dtype_bytes) - act
    blocks = kv_cache_memory // (block_size * model.kv_bytes_per_token(tp, pp, dtype_bytes))
    if blocks < 1:
        raise ValueError(f"{model.name} does not fit {tp * pp} x {gpu.name} at TP{tp} PP{pp}: "
                         f"no memory is left for the KV cache")
    return int(blocks)
