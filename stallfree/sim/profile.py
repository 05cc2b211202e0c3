"""`stallfree profile`: measure this machine's engine costs in the layout the cost model reads.

Writes, under `--out` (default ./profiles), for device `cpu` (or --device-name):

    <device>/compute/<org>/<model>/mlp.csv   the engine's own layer modules, by token count,
                                             plus an `lm_head` op (logits of sampled rows)
    <device>/compute/attention_n<H>_q<Q>_kv<K>_tp1.csv
                                             the engine's paged_attention, prefill chunks by
                                             cached tokens, decode batches by gathered tokens
    <device>/cpu_overheads.csv               per-iteration time of real `LLMEngine.step()`
                                             decode batches minus the summed op times above
    <device>/host.json                       wall seconds per CPU second of those steps

Times are CPU seconds of this process, not wall seconds: an op's microbenchmark
(microseconds) is never preempted while a whole iteration (tenths of a second) shares
the core with whatever else runs, so wall-clock medians would mix a quiet machine
(ops) with a busy one (steps). The busy machine is one factor, `wall_per_cpu` in
host.json, that the cost model applies to every iteration (1.0 on a quiet core; override
with `stallfree simulate --cpu-slowdown`).

Then `stallfree simulate --gpu cpu --profile-dir <out> --model smollm2-135m ...` predicts
this machine. The default grid runs in about two minutes on two cores; --quick is a smoke run.
"""
from __future__ import annotations

import argparse
import csv
import itertools
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

# Decode attention here gathers each length group's KV padded to the group's longest
# context (stallfree/attention_plan.py); a group's cost follows the tokens it gathers. So
# the decode grid is a list of gathered-token counts, read by each batch size at context =
# tokens / batch (contexts 16 to 2048).
FULL = {"tokens": [1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048],
        "chunks": [16, 64, 256, 512, 1024, 2048], "cached": [0, 256, 1024, 2048],
        "batches": [1, 2, 4, 8, 16, 32, 48, 64, 96, 128],
        "decode_tokens": [32, 128, 512, 2048, 4096, 8192, 16384, 24576, 32768, 49152, 65536,
                          98304, 131072],
        "step_batches": [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64], "repeats": 5}
QUICK = {"tokens": [1, 16, 128], "chunks": [16, 128], "cached": [0, 128],
         "batches": [1, 4], "decode_tokens": [32, 256, 1024], "step_batches": [1, 4],
         "repeats": 2}
MIN_CONTEXT, MAX_CONTEXT = 16, 2048
COLD_BYTES = 128 << 20  # KV read between two calls of one case: more than the CPU caches
# Engine steps (for the time outside the ops) are dense at small batches: a light load runs
# 1-8 decodes an iteration, where the step time is far from linear in the batch size.
PROMPT_LEN = 32  # prompts of the engine-step runs: short, so their prefills stay cheap
BLOCK = 16
LM_HEAD_MAX_ROWS = 256  # logits of more rows than requests in a batch are never computed
OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj",
       "post_attention_layernorm", "mlp_up_proj", "mlp_act", "mlp_down_proj", "add", "lm_head")


def add_profile_args(subparsers: Any) -> argparse.ArgumentParser:
    p = subparsers.add_parser("profile", help="measure this machine's costs for the simulator")
    p.add_argument("--model", default=None, help="engine model (default: SmolLM2-135M-Instruct)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, choices=["float32", "float16", "bfloat16"])
    p.add_argument("--device-name", default=None, help="folder name (default: the device type)")
    p.add_argument("--out", default="profiles", help="profile root to write into")
    p.add_argument("--quick", action="store_true", help="tiny grids: a smoke run")
    return p


def _stats(ms: list[float]) -> dict[str, float]:
    return {"min": min(ms), "max": max(ms), "mean": statistics.fmean(ms),
            "median": statistics.median(ms), "std": statistics.pstdev(ms)}


def _time(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """CPU milliseconds of `fn` (all threads of this process): other processes don't count."""
    for _ in range(warmup):  # first calls allocate
        fn()
    ms = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        ms.append((time.process_time() - t) * 1e3)
    return _stats(ms)


def _cols(op: str, s: dict[str, float]) -> dict[str, float]:
    return {f"time_stats.{op}.{k}": v for k, v in s.items()}


def _write(path: Path, rows: list[dict[str, Any]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    print(f"wrote {path} ({len(rows)} rows)", flush=True)


def profile_ops(model: Any, cfg: Any, grid: dict[str, Any], torch: Any) -> list[dict[str, Any]]:
    """Each token-level op of layer 0 (and the embedding / LM head) at each token count."""
    shape = {"n_head": cfg.num_attention_heads, "n_kv_head": cfg.num_key_value_heads,
             "n_embd": cfg.hidden_size, "n_expanded_embd": cfg.intermediate_size,
             "vocab_size": cfg.vocab_size, "use_gated_mlp": True,
             "num_tensor_parallel_workers": 1}
    return [_ops_row(model, cfg, t, grid["repeats"], torch) | shape | {"num_tokens": t}
            for t in grid["tokens"]]


def _ops_row(model: Any, cfg: Any, t: int, repeats: int, torch: Any) -> dict[str, Any]:
    import torch.nn.functional as F

    from ..model.layers import apply_rope

    layer = model.model.layers[0]
    attn, h, hd, inter = layer.self_attn, cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    weight = model.model.embed_tokens.weight
    dev, dt = weight.device, weight.dtype
    x, y = torch.randn(t, h, dtype=dt, device=dev), torch.randn(t, h, dtype=dt, device=dev)
    ids = torch.randint(0, cfg.vocab_size, (t,), device=dev)
    cos, sin = model.model.rotary.lookup(torch.arange(t, device=dev), dt)
    qk = torch.randn(t, cfg.num_attention_heads + cfg.num_key_value_heads, hd, dtype=dt,
                     device=dev)
    up = torch.randn(t, 2 * inter, dtype=dt, device=dev)
    attn_out = torch.randn(t, attn.q_size, dtype=dt, device=dev)
    fns = {"emb": lambda: model.model.embed_tokens(ids),
           "input_layernorm": lambda: layer.input_layernorm(x),
           "attn_pre_proj": lambda: attn.qkv_proj(x),
           "attn_rope": lambda: apply_rope(qk, cos, sin),
           "attn_post_proj": lambda: attn.o_proj(attn_out),
           "post_attention_layernorm": lambda: layer.post_attention_layernorm(x),
           "mlp_up_proj": lambda: layer.mlp.gate_up_proj(x),
           "mlp_act": lambda: F.silu(up[:, :inter]) * up[:, inter:],
           "mlp_down_proj": lambda: layer.mlp.down_proj(up[:, :inter]),
           "add": lambda: x + y,
           "lm_head": lambda: model.compute_logits(x)}
    row: dict[str, Any] = {}
    for op in OPS:
        if op == "lm_head" and t > LM_HEAD_MAX_ROWS:  # blank: the reader scales up
            row |= {k: "" for k in _cols(op, _stats([0.0]))}
        else:
            row |= _cols(op, _time(fns[op], repeats))
    return row


def profile_attention(cfg: Any, grid: dict[str, Any], torch: Any, dev: Any,
                      dt: Any) -> list[dict[str, Any]]:
    """The engine's paged_attention for one layer: prefill (chunk, cached), decode (batch, ctx)."""
    cases = [(1, c, k) for c in grid["chunks"] for k in grid["cached"] if c + k <= 4096]
    cases += [(b, 0, ctx) for b in grid["batches"]
              for ctx in sorted({n // b for n in grid["decode_tokens"]})
              if MIN_CONTEXT <= ctx <= MAX_CONTEXT]
    # One KV cache for every case, allocated once like the engine's.
    layers = cfg.num_hidden_layers
    size = torch.tensor([], dtype=dt).element_size()
    blocks = max(b * _blocks(c, k) * _copies(b * _blocks(c, k), cfg, layers, size)
                 for b, c, k in cases)
    cache = torch.zeros(2, blocks, BLOCK, cfg.num_key_value_heads, cfg.head_dim, dtype=dt,
                        device=dev)
    return [_attention_row(cfg, b, c, k, grid["repeats"], torch, cache, layers, size)
            for b, c, k in cases]


def _blocks(chunk: int, cached: int) -> int:
    """KV blocks of one request: its cached tokens plus this chunk (one token for a decode)."""
    return -(-(cached + max(chunk, 1)) // BLOCK)


def _copies(blocks: int, cfg: Any, layers: int, itemsize: int) -> int:
    """How many disjoint copies of a case's KV to rotate through so each call reads it cold.

    The engine reads a different layer's KV for each of its `layers` calls an iteration, so
    its KV comes from memory, not the caches; reading one copy again and again would be too
    fast by up to a quarter at the contexts a light load reaches (8 MB of KV a layer).
    """
    nbytes = 2 * blocks * BLOCK * cfg.num_key_value_heads * cfg.head_dim * itemsize
    return max(1, min(layers, -(-COLD_BYTES // nbytes)))


def _attention_row(cfg: Any, batch: int, chunk: int, cached: int, repeats: int, torch: Any,
                   cache: Any, layers: int, itemsize: int) -> dict[str, Any]:
    """One prefill chunk (chunk > 0) after `cached` tokens, or `batch` decodes at that context."""
    from ..model.attention import AttentionMetadata, GatherWorkspace, paged_attention

    hq, hkv, hd = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
    dev, dt = cache.device, cache.dtype
    prefill = chunk > 0
    per_seq = _blocks(chunk, cached)
    case = batch * per_seq
    workspace = GatherWorkspace()  # shared by the case's batches, as by the engine's layers
    built = [AttentionMetadata.build(
        [(cached if prefill else cached - 1, chunk if prefill else 1,
          list(range(j * case + i * per_seq, j * case + (i + 1) * per_seq)))
         for i in range(batch)], BLOCK, dev, workspace)
        for j in range(_copies(case, cfg, layers, itemsize))]
    for meta in built:  # once per iteration in the engine, not per layer: not timed
        meta.prepare(cache)
    metas = itertools.cycle(built)
    n = chunk if prefill else batch
    q = torch.randn(n, hq, hd, dtype=dt, device=dev)
    k, v = (torch.randn(n, hkv, hd, dtype=dt, device=dev) for _ in range(2))
    # Warm-up calls grow the gather workspace and settle the CPU caches, as in a running engine.
    s = _time(lambda: paged_attention(q, k, v, cache, next(metas), hd ** -0.5), repeats,
              warmup=3)
    zero = _stats([0.0])
    timed, blank = ("attn_prefill", "attn_decode") if prefill else ("attn_decode",
                                                                     "attn_prefill")
    row = _cols("attn_input_reshape", zero) | _cols("attn_output_reshape", zero)
    row |= _cols(timed, s) | {key: "" for key in _cols(blank, zero)}
    return row | {"n_embd": hq * hd, "n_q_head": hq, "n_kv_head": hkv, "block_size": BLOCK,
                  "num_tensor_parallel_workers": 1, "max_model_len": 4096, "batch_size": batch,
                  "prefill_chunk_size": chunk, "kv_cache_size": cached, "is_prefill": prefill,
                  "attention_backend": "stallfree.paged_attention", "profile_method": "cpu",
                  # The kernel caps its calls by KV bytes on CPU only (0: not capped).
                  "kv_dtype_bytes": itemsize if dev.type == "cpu" else 0}


def profile_steps(engine: Any, grid: dict[str, Any]
                  ) -> tuple[dict[int, tuple[list[float], int]], float, float]:
    """CPU times of `LLMEngine.step()` on decode-only batches: batch -> (seconds of each
    step, mean context); and the wall and CPU seconds of all those steps."""
    import random

    from ..sampling_params import SamplingParams

    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    out, wall, cpu = {}, 0.0, 0.0
    for b in grid["step_batches"]:
        ids = [f"p{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)],
                               SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0))
        while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()  # warm-up decode
        ms = []
        for _ in range(grid["repeats"] + 2):
            t, c = time.perf_counter(), time.process_time()
            engine.step()
            ms.append(time.process_time() - c)
            wall, cpu = wall + time.perf_counter() - t, cpu + ms[-1]
        ctx = statistics.mean(r.num_computed_tokens for r in engine.scheduler.running)
        out[b] = (ms, int(ctx))
        for rid in ids:
            engine.abort_request(rid)
    return out, wall, cpu


def run_profile(args: argparse.Namespace) -> int:
    import torch

    from ..config import CacheConfig, EngineConfig, SchedulerConfig
    from ..engine import LLMEngine
    from .cost_model import BatchShape, ProfiledCostModel
    from .hardware import GpuSpec, ModelSpec

    grid = QUICK if args.quick else FULL
    started = time.perf_counter()
    sched = SchedulerConfig("sarathi", token_budget=4096, max_num_seqs=256, max_model_len=4096)
    engine = LLMEngine(EngineConfig(model=args.model, dtype=args.dtype, device=args.device,
                                    scheduler=sched, cache=CacheConfig(kv_cache_memory=1 << 28)))
    cfg, device = engine.model_config, engine.device
    name = args.device_name or device.type
    root = Path(args.out)
    org_model = ("HuggingFaceTB/SmolLM2-135M-Instruct" if args.model is None
                 else f"local/{os.path.basename(os.path.normpath(args.model))}")
    print(f"profiling {org_model} on {device} ({engine.dtype}), {torch.get_num_threads()} "
          f"threads -> {root / name}", flush=True)
    with torch.inference_mode():
        # Engine steps run before and after the microbenchmarks, their samples pooled: a
        # shared machine's speed drifts over a minute, and one burst of steps caught it
        # 10-15% fast or slow from one profile to the next.
        first, wall, cpu = profile_steps(engine, grid)
        _write(root / name / "compute" / org_model / "mlp.csv",
               profile_ops(engine.model, cfg, grid, torch))
        _write(root / name / "compute" / f"attention_n{cfg.num_attention_heads * cfg.head_dim}"
               f"_q{cfg.num_attention_heads}_kv{cfg.num_key_value_heads}_tp1.csv",
               profile_attention(cfg, grid, torch, device, engine.dtype))
        second, wall2, cpu2 = profile_steps(engine, grid)
    steps = {b: (statistics.median(first[b][0] + second[b][0]), second[b][1]) for b in first}
    wall_per_cpu = (wall + wall2) / (cpu + cpu2)
    spec = ModelSpec(org_model, cfg.num_hidden_layers, cfg.hidden_size, cfg.intermediate_size,
                     cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim,
                     cfg.vocab_size, tie_word_embeddings=cfg.tie_word_embeddings,
                     profile_name=org_model)
    ops = ProfiledCostModel(spec, GpuSpec(name, 0, 1e12, 1e10, 1e10, None), root=root,
                            slowdown=1.0)  # CPU seconds, as measured
    rows = []
    for b, (seconds, ctx) in sorted(steps.items()):
        residual = max(0.0, seconds - ops.iteration(BatchShape.decode(b, ctx)).stage) * 1e3
        print(f"  decode batch {b:4d} (context {ctx}): step {seconds * 1e3:.2f} ms CPU, "
              f"outside the ops {residual:.2f} ms", flush=True)
        parts = {"schedule": 0.0, "sampler_e2e": 0.0, "prepare_inputs_e2e": residual,
                 "process_model_outputs": 0.0}
        rows.append({f"{k}_{s}": v for k, v in parts.items() for s in ("mean", "median")}
                    | {"model_name": org_model, "batch_size": b, "tensor_parallel_degree": 1,
                       "ray_comm_time_mean": 0.0})
    _write(root / name / "cpu_overheads.csv", rows)
    host = {"wall_per_cpu": round(wall_per_cpu, 4), "threads": torch.get_num_threads(),
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
    (root / name / "host.json").write_text(json.dumps(host, indent=1) + "\n")
    print(f"  wall per CPU second of the steps: {wall_per_cpu:.2f} (1.0 on a quiet core)")
    print(f"done in {time.perf_counter() - started:.0f} s", flush=True)
    return 0
