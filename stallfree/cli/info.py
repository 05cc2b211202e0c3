"""`stallfree info`: this machine's hardware facts and the kernel table an engine with these
settings would use (the same choice the engine makes at load, and logs)."""
from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING, Any

from ..config import CacheConfig, EngineConfig, ParallelConfig, resolve_device, resolve_threads
from .args import add_setting_args, pick, settings_from_args

if TYPE_CHECKING:
    import torch

    from ..model.config import ModelConfig


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("info", help="hardware facts and the kernel table an engine "
                                           "would use")
    add_setting_args(p, pick(EngineConfig, "model", "dtype", "device", "threads", "kernels",
                                  "quantization"))
    add_setting_args(p, pick(ParallelConfig, "tensor_parallel_size"))
    add_setting_args(p, pick(CacheConfig, "kv_cache_dtype"))
    p.add_argument("--json", action="store_true", help="one JSON object")
    return p


def _cpu_name(path: str = "/proc/cpuinfo") -> str:
    try:
        with open(path) as f:
            line = next((line for line in f if line.startswith("model name")), "")
    except OSError:
        line = ""
    return line.partition(":")[2].strip() or "unknown"


def _model_config(model: str | None) -> ModelConfig | None:
    """The model's description (its head size decides some kernels), None where it cannot
    be read: the table then leaves the shape to each call."""
    from ..model.loader import load_model_config

    try:
        return load_model_config(model)
    except (OSError, ValueError):
        return None


def _weights(config: EngineConfig) -> tuple[str, bool]:
    """What loading the model would do to its matmul weights (the `quantization` setting),
    and whether some would be quantized."""
    import torch

    from ..model.loader import planned_weights
    from ..model.parallel import Shard

    device = torch.device(resolve_device(config.device, torch.cuda.is_available()))
    try:
        return planned_weights(config.model, config.quantization, device,
                               Shard(tp_size=config.parallel.tensor_parallel_size))
    except (OSError, ValueError) as e:
        return f"unknown ({e})", False


def _kv_cache(dtype: torch.dtype) -> str:
    """The KV cache's dtype, and what a row of it holds where that is not plain."""
    from ..model import kv_quant

    name = str(dtype).removeprefix("torch.")
    if not kv_quant.is_quantized(dtype):
        return name
    return f"{name} (per token and head: head_dim values, then a float32 scale)"


def run(args: argparse.Namespace) -> int:
    import os

    import torch

    from .. import huge_pages
    from ..engine import choose_dtype
    from ..executor.hardware import available_cores
    from ..model import kv_quant
    from ..model.kernel_table import Choice, KernelFacts, choose_kernels
    from ..model.layer_steps import model_native_reason

    settings = (settings_from_args(EngineConfig, args) | settings_from_args(ParallelConfig, args)
                | settings_from_args(CacheConfig, args))
    config = EngineConfig.from_kwargs(**settings)
    device = resolve_device(config.device, torch.cuda.is_available())
    device_type = torch.device(device).type
    threads = resolve_threads(config.threads, os.environ.get("OMP_NUM_THREADS"),
                              available_cores())
    if device_type == "cpu":
        torch.set_num_threads(threads)  # the bf16 probe times this many, as the engine's does
    dtype_name, why = choose_dtype(config.dtype, device_type)
    model = _model_config(config.model)
    head_dim = None if model is None else model.head_dim
    weights, quantized = _weights(config)
    facts = KernelFacts.here()
    table = choose_kernels(config.kernels, dtype=getattr(torch, dtype_name),
                           device_type=device_type,
                           tp_size=config.parallel.tensor_parallel_size, head_dim=head_dim,
                           facts=facts, quantized=quantized)
    native_reason = None if model is None else model_native_reason(model)
    if native_reason is not None and table.layer_loop.kernel:
        table = table.with_choice("layer_loop", Choice("python", native_reason))
    hardware = [("cpu", f"{_cpu_name()}, {available_cores()} cores for this process"),
                *facts.lines(), ("huge pages", huge_pages.status())]
    engine = [("device", device), ("dtype", f"{dtype_name} ({why})"),
              ("threads", str(threads)), ("weights", weights),
              ("kv cache", _kv_cache(kv_quant.cache_dtype(config.cache.kv_cache_dtype,
                                                           getattr(torch, dtype_name)))),
              ("model", "unknown" if model is None else
               f"{model.architecture}: {', '.join(model.layer_features()) or 'Llama layers'}"),
              ("head_dim", "unknown (no model)" if head_dim is None else str(head_dim))]
    if args.json:
        print(json.dumps({"hardware": dict(hardware), "engine": dict(engine),
                          "kernels": {op: {"impl": impl, "reason": reason}
                                      for op, impl, reason in table.rows()}}))
        return 0
    for title, pairs in (("hardware", hardware), ("engine", engine)):
        print(title)
        width = max(len(k) for k, _ in pairs)
        print("\n".join(f"  {k:<{width}}  {v}" for k, v in pairs))
    print("kernel table (override with --kernels OP=IMPL,...)")
    rows = [("op", "impl", "why"), *table.rows()]
    op_w, impl_w = (max(len(r[i]) for r in rows) for i in (0, 1))
    print("\n".join(f"  {op:<{op_w}}  {impl:<{impl_w}}  {reason}" for op, impl, reason in rows))
    return 0
