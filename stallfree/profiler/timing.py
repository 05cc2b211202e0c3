"""CPU time of a call: what every profile measurement is."""
from __future__ import annotations

import time
from collections.abc import Callable, Hashable
from typing import Any

from ..sim.profile_csv import time_stats

# Passes over a whole grid of measurements: a shared machine has slow moments of a second or
# two (one profile's 256-token row of layer ops came out at twice its neighbours' cost per
# token), and a row measured in one burst takes all of such a moment. Spread over passes,
# a moment falls on one pass of a row's calls, and the median passes it by.
PASSES = 3


def cpu_ms_interleaved(calls: dict[Hashable, tuple[Callable[[], Any], int]], warmup: int = 1
                       ) -> dict[Hashable, dict[str, float]]:
    """CPU milliseconds of each (fn, repeats) (all threads of this process: other processes
    don't count), in PASSES passes over all of them, each pass making a share of every fn's
    calls: the stats of each fn pool its passes."""
    for fn, _ in calls.values():
        for _ in range(warmup):  # first calls allocate
            fn()
    samples: dict[Hashable, list[float]] = {key: [] for key in calls}
    for _ in range(PASSES):
        for key, (fn, repeats) in calls.items():
            samples[key] += _samples(fn, -(-repeats // PASSES))
    return {key: time_stats(ms) for key, ms in samples.items()}


def _samples(fn: Callable[[], Any], repeats: int) -> list[float]:
    ms = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        ms.append((time.process_time() - t) * 1e3)
    return ms
