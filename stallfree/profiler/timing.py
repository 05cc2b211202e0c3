"""CPU time of a call: what every profile measurement is."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ..sim.profile_csv import time_stats


def cpu_ms(fn: Callable[[], Any], repeats: int, warmup: int = 1) -> dict[str, float]:
    """CPU milliseconds of `fn` (all threads of this process): other processes don't count."""
    for _ in range(warmup):  # first calls allocate
        fn()
    ms = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        ms.append((time.process_time() - t) * 1e3)
    return time_stats(ms)
