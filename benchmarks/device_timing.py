"""Timing on the device a benchmark runs on: a GPU runs its kernels after their launch, so
a call is timed to their end."""
from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], object], rounds: int, device: torch.device,
                   calls: int = 10) -> float:
    """Median seconds of one call over `rounds` rounds of `calls` calls each, after one
    untimed call (it compiles, prepares and grows buffers)."""
    fn()
    times = []
    for _ in range(rounds):
        synchronize(device)
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize(device)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def device_name(device: torch.device) -> str:
    return (f"{device} ({torch.cuda.get_device_name(device)})" if device.type == "cuda"
            else str(device))
