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

    @property
    def allreduces_per_layer(self) -> int:
        return 1 if self.parallel_attn else 2

    # ---- sizes (whole model, unsharded) -------------------------------------------------
    def layer_params(self) -> int:
        h, hd = self.hidden_size, self.head_dim
        attn = h * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * h
        mlp = (3 if self.gated_mlp else 2) * h * self.intermediate_size
        return attn + mlp + 2 * h  # + two norms

    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    def num_params(self) -> int:
        head = 0 if self.tie_word_embeddings else self.embedding_params()
        return self.num_layers * self.layer_params() + self.embedding_params() + head

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
        h, i = model.hidden_size, model.intermediate_size * (2 if model.gated_mlp else 1)
        qkv = (model.num_heads + 2 * model.num_kv_heads) * model.head_dim
        act = max_batched_tokens * (4 * h + (qkv + i) // tp) * dtype_bytes
        kv_cache_memory = int(gpu.memory_bytes * gpu_memory_utilization) \
            - model.weight_bytes_per_rank(tp, pp, dtype_bytes) - act
    blocks = kv_cache_memory // (block_size * model.kv_bytes_per_token(tp, pp, dtype_bytes))
    if blocks < 1:
        raise ValueError(f"{model.name} does not fit {tp * pp} x {gpu.name} at TP{tp} PP{pp}: "
                         f"no memory is left for the KV cache")
    return int(blocks)
