"""One rank: loads its shard of the weights, then runs the engine's batches until told to stop.

Started by the engine for local ranks, or by hand (`stallfree worker`) on other
machines with the standard torch.distributed environment: MASTER_ADDR and
MASTER_PORT (the engine's store), RANK, WORLD_SIZE and LOCAL_RANK, plus the run's
secret ($STALLFREE_WORKER_SECRET or $STALLFREE_WORKER_SECRET_FILE) that signs every
message (docs/parallelism.md). A thread posts a heartbeat every HEARTBEAT_S, so the
engine notices a rank that hangs or vanishes without a word.
"""
from __future__ import annotations

import datetime
import logging
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

from .channel import Channel, secret_from_env
from .messages import (
    STOP_KEY,
    KvMessage,
    Message,
    RunMessage,
    WorkerConfig,
    WorkerInfo,
    result_message,
    worker_batch,
)

__all__ = ["WorkerConfig", "WorkerInfo", "main"]

_STORE_TIMEOUT = datetime.timedelta(seconds=60)
HEARTBEAT_S = 0.5


def main() -> int:
    env = os.environ
    try:
        rank, world = int(env["RANK"]), int(env["WORLD_SIZE"])
        addr, port = env["MASTER_ADDR"], int(env["MASTER_PORT"])
        secret = secret_from_env()
    except KeyError as exc:
        print(f"stallfree worker: {exc.args[0]} is not set (needs MASTER_ADDR, MASTER_PORT, "
              f"RANK, WORLD_SIZE)", file=sys.stderr)
        return 2
    except (ValueError, OSError) as exc:
        print(f"stallfree worker: {exc}", file=sys.stderr)
        return 2
    if secret is None:
        print("stallfree worker: no secret: set STALLFREE_WORKER_SECRET (or "
              "STALLFREE_WORKER_SECRET_FILE) to the engine's", file=sys.stderr)
        return 2
    # What the channel logs (a forged key it ignored) goes to stderr, naming this rank.
    logging.basicConfig(format=f"stallfree worker rank {rank}: %(message)s")
    store = dist.TCPStore(addr, port, is_master=False, timeout=_STORE_TIMEOUT)
    channel = Channel(store, secret)
    _start_heartbeat(addr, port, secret, rank)
    try:
        _serve(channel, rank, world, int(env.get("LOCAL_RANK", rank)))
    except KeyboardInterrupt:
        return 130
    except SystemExit as stop:  # asked to stop, or the engine is gone
        return int(stop.code or 0)
    except BaseException as exc:  # noqa: BLE001 - report any failure to the engine, then exit
        try:
            channel.put("error", f"worker rank {rank} failed: {type(exc).__name__}: "
                                 f"{str(exc)[:500]} (traceback in its stderr)")
        except Exception:  # noqa: BLE001 - the store itself may be gone
            pass
        raise
    return 0


def _start_heartbeat(addr: str, port: int, secret: bytes, rank: int) -> None:
    """Posts hb/<rank> = a counter every HEARTBEAT_S, on its own connection (a store
    client is not shared between threads), until the process ends."""
    def beat() -> None:
        try:
            channel = Channel(dist.TCPStore(addr, port, is_master=False,
                                            timeout=_STORE_TIMEOUT), secret)
            count = 0
            while True:
                channel.put(f"hb/{rank}", count)
                count += 1
                time.sleep(HEARTBEAT_S)
        except Exception:  # noqa: BLE001 - the engine is gone; the main thread notices too
            return

    threading.Thread(target=beat, name="stallfree-heartbeat", daemon=True).start()


def _serve(channel: Channel, rank: int, world: int, local_rank: int) -> None:
    from ..model.loader import load_model
    from ..model.parallel import Shard
    from .pipe import StagePipe

    cfg = channel.get("config", WorkerConfig)
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
    dist.init_process_group(backend, store=dist.PrefixStore("pg", channel.store), rank=rank,
                            world_size=world)
    # Every rank creates every TP group, in the same order, as new_group requires.
    groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(pp)]
    shard = Shard.of_rank(rank, tp, pp, groups[rank // tp])
    dtype = getattr(torch, cfg.dtype)  # resolved by the engine
    model, model_config = load_model(cfg.model, dtype, device, shard, cfg.kernels,
                                     cfg.quantization)
    pipe = StagePipe(rank, tp, model_config.hidden_size, dtype, device) if pp > 1 else None
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    weight_bytes = sum(model.weight_numels().values()) * dtype.itemsize
    channel.put(f"ready/{rank}", WorkerInfo(rank, os.getpid(), os.uname().nodename,
                                            weight_bytes, free))
    parent = os.getppid()

    def check() -> None:
        if os.getppid() != parent:
            raise SystemExit(0)
        # Only the engine's signed stop counts: a forged one is ignored (and logged).
        if channel.read_genuine(STOP_KEY, bool):
            raise SystemExit(0)

    try:
        _loop(channel, rank, shard, model, model_config, dtype, device, cfg.seed, pipe, check)
    except SystemExit:  # a clean stop: every batch is done, so pending sends complete
        if pipe is not None:
            pipe.flush()
        dist.destroy_process_group()
        raise


def _loop(channel: Channel, rank: int, shard, model, model_config, dtype: torch.dtype,
          device: torch.device, seed: int, pipe, check) -> None:
    """Runs messages msg/0, msg/1, ... in order until `check` raises SystemExit."""
    from ..executor.model_runner import ModelRunner
    from ..model import kv_quant

    reporter = shard.is_last_stage and shard.tp_rank == 0
    runner = None
    index = 0
    while True:
        # A forged message is skipped here, never decoded: the engine's overwrites it.
        message = channel.get(f"msg/{index}", Message, check)
        if isinstance(message, KvMessage):  # (re)allocate the KV cache
            runner = None  # free the old cache first
            runner = ModelRunner(model, model_config, message.num_blocks, message.block_size,
                                 kv_quant.cache_dtype(message.kv_cache_dtype, dtype), device,
                                 seed, pipe)
            channel.put(f"ack/{index}/{rank}", True)
        elif isinstance(message, RunMessage):
            start = time.monotonic()
            result = runner.execute(worker_batch(message))
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # kernels run async: time their end, not launch
            if shard.tp_rank == 0:
                channel.put(f"times/{index}/{shard.pp_rank}", (start, time.monotonic()))
            if reporter:
                channel.put(f"out/{index}", result_message(result))
        index += 1
