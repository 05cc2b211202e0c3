"""What this machine offers the model: cores, and whether bfloat16 matmuls are fast.

Some of this project's CPUs have AMX or AVX512_BF16 (bf16 matmuls several times
float32's), others only AVX2 (bf16 emulated, hundreds of times slower). The flags
say what the CPU has; a sub-second timed matmul of both dtypes confirms that this
torch build actually uses it.
"""
from __future__ import annotations

import functools
import os
import time
from dataclasses import dataclass

import torch

from ..model.kernels import vector_flags

__all__ = ["Bf16Probe", "available_cores", "cpu_flags", "probe_cpu_bf16", "vector_flags"]

BF16_FLAGS = ("amx_bf16", "avx512_bf16")
# bf16 must beat float32 by this much to be worth its rounding.
MIN_BF16_SPEEDUP = 1.2
_PROBE_SHAPE = (256, 512, 512)  # (m, k, n): ~2-4 ms per fp32 call on one core


def cpu_flags(path: str = "/proc/cpuinfo") -> frozenset[str]:
    """The CPU's feature flags (empty where /proc/cpuinfo is not there)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith("flags"):
                    return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a container)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Bf16Probe:
    fast: bool
    reason: str  # why, for the start-up log and the engine_info metric
    bf16_flags: tuple[str, ...] = ()
    fp32_gflops: float = 0.0
    bf16_gflops: float = 0.0


def _matmul_gflops(dtype: torch.dtype, repeats: int = 7) -> float:
    """One thread's matmul rate, from the fastest of a few calls: a single thread has no
    barrier to stall when another process takes a core, and the minimum drops the calls
    it interrupted."""
    m, k, n = _PROBE_SHAPE
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(k, n).to(dtype)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        a @ b  # first call: library dispatch and packing
        best = float("inf")
        for _ in range(repeats):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return 2 * m * k * n / best / 1e9


@functools.lru_cache(maxsize=1)
def probe_cpu_bf16() -> Bf16Probe:
    """Whether bf16 is the faster dtype on this CPU: the flags, then a timed matmul."""
    flags = tuple(f for f in BF16_FLAGS if f in cpu_flags())
    if not flags:
        return Bf16Probe(False, f"CPU has neither {' nor '.join(BF16_FLAGS)}")
    fp32, bf16 = _matmul_gflops(torch.float32), _matmul_gflops(torch.bfloat16)
    speedup = bf16 / fp32
    fast = speedup >= MIN_BF16_SPEEDUP
    verdict = "faster" if fast else f"not {MIN_BF16_SPEEDUP}x faster"
    return Bf16Probe(fast, f"{'+'.join(flags)}; bf16 matmul {bf16:.0f} vs float32 {fp32:.0f} "
                           f"GFLOP/s ({speedup:.1f}x, {verdict})", flags, fp32, bf16)
