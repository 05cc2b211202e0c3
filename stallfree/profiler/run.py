"""`stallfree profile`: the whole profile of this machine, written where the cost model reads.

See the package docstring for the files; `ProfileConfig` holds the command's settings.
"""
from __future__ import annotations

import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..config import DTYPE_CHOICES, CacheConfig, EngineConfig, SchedulerConfig, option
from ..sim import profile_store as P
from ..sim.cost_model import BatchShape, ProfiledCostModel
from ..sim.hardware import GpuSpec, ModelSpec
from ..sim.profile_csv import write_csv

# Decode attention's cost follows the KV tokens it reads: in place (the CPU kernel), or
# gathered per length group padded to the group's longest (the torch path,
# stallfree/attention_plan.py). So the decode grid is a list of token counts, read by each
# batch size at context = tokens / batch (contexts 16 to 2048). Engine steps (for the time
# outside the ops) are dense at small batches: a light load runs 1-8 decodes an iteration,
# where the step time is far from linear in the batch size. A light load's predicted decode
# is its batch's measured step plus attention's growth with context (cpu_overhead_rows), so
# the steps get 20 calls a batch (7 left batch 1's median 1-2 ms apart between profiles).
FULL = {"tokens": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048],
        "chunks": [16, 64, 256, 512, 1024, 2048], "cached": [0, 256, 1024, 2048],
        "batches": [1, 2, 4, 8, 16, 32, 48, 64, 96, 128],
        "decode_tokens": [32, 128, 512, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536,
                          98304, 131072],
        "step_batches": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64], "repeats": 5,
        "step_repeats": 20}
QUICK = {"tokens": [1, 16, 128], "chunks": [16, 128], "cached": [0, 128],
         "batches": [1, 4], "decode_tokens": [32, 256, 1024], "step_batches": [1, 4],
         "repeats": 2, "step_repeats": 3}


@dataclass
class ProfileConfig:
    model: str | None = option(None, "engine model (default: SmolLM2-135M-Instruct)")
    device: str = option("cpu", "device to profile")
    dtype: str | None = option(None, "weights and KV dtype (default and auto: what the "
                               "engine picks on this device)", choices=DTYPE_CHOICES)
    device_name: str | None = option(None, "folder name (default: the device type)")
    out: str = option("profiles", "profile root to write into")
    quick: bool = option(False, "tiny grids: a smoke run")


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    write_csv(path, rows)
    print(f"wrote {path} ({len(rows)} rows)", flush=True)


def run_profile(cfg: ProfileConfig) -> Path:
    """Profiles the engine on this machine; returns the folder written."""
    import torch  # with the engine and the model: only when a profile runs

    from ..engine import LLMEngine
    from .attention import profile_attention
    from .ops import profile_ops
    from .steps import profile_steps

    grid = QUICK if cfg.quick else FULL
    started = time.perf_counter()
    sched = SchedulerConfig("sarathi", token_budget=4096, max_num_seqs=256, max_model_len=4096)
    engine = LLMEngine(EngineConfig(model=cfg.model, dtype=cfg.dtype, device=cfg.device,
                                    scheduler=sched, cache=CacheConfig(kv_cache_memory=1 << 28)))
    model_cfg, device = engine.model_config, engine.device
    folder = Path(cfg.out) / (cfg.device_name or device.type)
    org_model = ("HuggingFaceTB/SmolLM2-135M-Instruct" if cfg.model is None
                 else f"local/{os.path.basename(os.path.normpath(cfg.model))}")
    print(f"profiling {org_model} on {device} ({engine.dtype}), {torch.get_num_threads()} "
          f"threads -> {folder}", flush=True)
    with torch.inference_mode():
        # Engine steps run before and after the microbenchmarks, their samples pooled: a
        # shared machine's speed drifts over a minute, and one burst of steps caught it
        # 10-15% fast or slow from one profile to the next.
        first, wall, cpu = profile_steps(engine, grid)
        _write(folder / "compute" / org_model / "mlp.csv",
               profile_ops(engine.executor.model, model_cfg, grid))  # one process: local
        heads, kv_heads = model_cfg.num_attention_heads, model_cfg.num_key_value_heads
        _write(folder / "compute" / f"attention_n{heads * model_cfg.head_dim}_q{heads}"
               f"_kv{kv_heads}_tp1.csv",
               profile_attention(model_cfg, grid, device, engine.dtype))
        second, wall2, cpu2 = profile_steps(engine, grid)
    steps = {b: (statistics.median(first[b][0] + second[b][0]), second[b][1]) for b in first}
    wall_per_cpu = (wall + wall2) / (cpu + cpu2)
    _write(folder / "cpu_overheads.csv",
           cpu_overhead_rows(steps, _model_spec(model_cfg, org_model), folder))
    host = {"wall_per_cpu": round(wall_per_cpu, 4), "threads": torch.get_num_threads(),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (folder / "host.json").write_text(json.dumps(host, indent=1) + "\n")
    print(f"  wall per CPU second of the steps: {wall_per_cpu:.2f} (1.0 on a quiet core)")
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return folder


def _model_spec(cfg: Any, org_model: str) -> ModelSpec:
    return ModelSpec(org_model, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                     cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                     profile_name=org_model)


def cpu_overhead_rows(steps: dict[int, tuple[float, int]], spec: ModelSpec,
                      folder: Path) -> list[dict[str, Any]]:
    """Each decode batch's step time (batch -> (CPU seconds, context)) minus the op times
    just written under `folder`: the time outside the ops, as cpu_overheads.csv rows.

    Signed: where the engine runs its layers in one C++ call, a step costs less than its ops
    timed one Python call at a time, and the negative difference corrects that (the cost model
    takes it off the stage). Clamped at zero, as it was, it only ever added, and predicted
    light loads 10-20% slow. Each batch keeps its own difference, not a line through them:
    the difference also cancels the noise of the ops at that token count, so a decode batch
    is predicted at its measured step (docs/simulation.md compares the two).
    """
    # An earlier profile's host times would count in the stage (when negative), and files
    # read before under these paths are cached: only what was just written may count.
    (folder / "cpu_overheads.csv").unlink(missing_ok=True)
    for load in (P.load_mlp, P.load_attention, P.load_cpu):
        load.cache_clear()
    ops = ProfiledCostModel(spec, GpuSpec(folder.name, 0, 1e12, 1e10, 1e10, None),
                            root=folder.parent, slowdown=1.0)  # CPU seconds, as measured
    rows = []
    for b, (seconds, ctx) in sorted(steps.items()):
        outside = (seconds - ops.iteration(BatchShape.decode(b, ctx)).stage) * 1e3
        print(f"  decode batch {b:4d} (context {ctx}): step {seconds * 1e3:.2f} ms CPU, "
              f"outside the ops {outside:+.2f} ms", flush=True)
        parts = {"schedule": 0.0, "sampler_e2e": 0.0, "prepare_inputs_e2e": outside,
                 "process_model_outputs": 0.0}
        rows.append({f"{k}_{s}": v for k, v in parts.items() for s in ("mean", "median")}
                    | {"model_name": spec.name, "batch_size": b, "tensor_parallel_degree": 1,
                       "ray_comm_time_mean": 0.0})
    return rows
