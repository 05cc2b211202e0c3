"""One rank: loads its shard of the weights, then runs the engine's batches until told to stop.

Started by the engine for local ranks, or by hand (`stallfree worker`) on other
machines with the standard torch.distributed environment: MASTER_ADDR and
MASTER_PORT (the engine's store), RANK, WORLD_SIZE and LOCAL_RANK.
"""
from __future__ import annotations

import datetime
import os
import sys
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from . import channel

_STORE_TIMEOUT = datetime.timedelta(seconds=60)


@dataclass
class WorkerConfig:
    """What the engine publishes for every rank under the store key "config"."""

    model: str | None
    dtype: str  # torch dtype name, e.g. "float32"
    device_type: str  # "cpu" or "cuda"
    tensor_parallel_size: int
    pipeline_parallel_size: int
    seed: int
    num_threads: int | None  # CPU threads per worker; None leaves torch's default


@dataclass
class WorkerInfo:
    """A rank's report once its shard is loaded (key "ready/<rank>")."""

    rank: int
    pid: int
    host: str
    weight_bytes: int
    free_memory: int | None  # accelerator memory left after the weights; None on CPU


def main() -> int:
    env = os.environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
    except KeyError as exc:
        print(f"stallfree worker: {exc.args[0]} is not set (needs MASTER_ADDR, MASTER_PORT, "
              f"RANK, WORLD_SIZE)", file=sys.stderr)
        return 2
    store = dist.TCPStore(addr, port, is_master=False, timeout=_STORE_TIMEOUT)
    try:
        _serve(store, rank, world, int(env.get("LOCAL_RANK", rank)))
    except KeyboardInterrupt:
        return 130
    except SystemExit as stop:  # asked to stop, or the engine is gone
        return int(stop.code or 0)
    except BaseException as exc:  # noqa: BLE001 - report any failure to the engine, then exit
        try:
            channel.put(store, "error", f"worker rank {rank} failed: {type(exc).__name__}: "
                                        f"{str(exc)[:500]} (traceback in its stderr)")
        except Exception:  # noqa: BLE001 - the store itself may be gone
            pass
        raise
    return 0


def _serve(store: dist.Store, rank: int, world: int, local_rank: int) -> None:
    from ..model.loader import load_model
    from ..model.parallel import Shard
    from .pipe import StagePipe

    cfg: WorkerConfig = channel.get(store, "config")
    tp, pp = cfg.tensor_parallel_size, cfg.pipeline_parallel_size
    if tp * pp != world:
        raise ValueError(f"WORLD_SIZE {world} != tensor x pipeline parallel size {tp} x {pp}")
    if cfg.device_type == "cuda":
        device = torch.device("cuda", local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
        if cfg.num_threads:
            torch.set_num_threads(cfg.num_threads)
    dist.init_process_group(backend, store=dist.PrefixStore("pg", store), rank=rank,
                            world_size=world)
    # Every rank creates every TP group, in the same order, as new_group requires.
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    shard = Shard.of_rank(rank, tp, pp, groups[rank // tp])
    dtype = getattr(torch, cfg.dtype)  # resolved by the engine
    model, model_config = load_model(cfg.model, dtype, device, shard)
    pipe = StagePipe(rank, tp, model_config.hidden_size, dtype, device) if pp > 1 else None
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    channel.put(store, f"ready/{rank}", WorkerInfo(rank, os.getpid(), os.uname().nodename,
                                                   weight_bytes, free))
    parent = os.getppid()

    def check() -> None:
        if store.check(["stop"]) or os.getppid() != parent:
            raise SystemExit(0)

    try:
        _loop(store, rank, shard, model, model_config, dtype, device, cfg.seed, pipe, check)
    except SystemExit:  # a clean stop: every batch is done, so pending sends complete
        if pipe is not None:
            pipe.flush()
        dist.destroy_process_group()
        raise


def _loop(store: dist.Store, rank: int, shard, model, model_config, dtype: torch.dtype,
          device: torch.device, seed: int, pipe, check) -> None:
    """Runs messages msg/0, msg/1, ... in order until `check` raises SystemExit."""
    from ..executor.model_runner import ModelRunner

    reporter = shard.is_last_stage and shard.tp_rank == 0
    runner = None
    index = 0
    while True:
        kind, payload = channel.get(store, f"msg/{index}", check)
        if kind == "kv":  # (re)allocate the KV cache: (num_blocks, block_size)
            runner = None  # free the old cache first
            runner = ModelRunner(model, model_config, *payload, dtype, device, seed, pipe)
            channel.put(store, f"ack/{index}/{rank}", True)
        elif kind == "run":
            start = time.monotonic()
            result = runner.execute(payload)
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # kernels run async: time their end, not launch
            if shard.tp_rank == 0:
                channel.put(store, f"times/{index}/{shard.pp_rank}", (start, time.monotonic()))
            if reporter:
                channel.put(store, f"out/{index}", result)
        else:
            raise ValueError(f"unknown message {kind!r}")
        index += 1

