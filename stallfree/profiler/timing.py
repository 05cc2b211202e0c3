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


def cpu_ms_interleaved(calls: dict[Hashable, tuple[Callable[[], Callable[[], Any]], int]],
                       warmup: int = 1) -> dict[Hashable, dict[str, float]]:
    """CPU milliseconds of each call (all threads of this process: other processes don't
    count), in PASSES passes over all of them, each pass making a share of every call's
    `repeats`: the stats of each pool its passes. A call comes as (make, repeats): make()
    builds its inputs and returns it, in each pass afresh, so that only one call's inputs
    live at a time; its first `warmup` calls there are not timed (they allocate)."""
    samples: dict[Hashable, list[float]] = {key: [] for key in calls}
    for _ in range(PASSES):
        for key, (make, repeats) in calls.items():
            fn = make()
            for _ in range(warmup):
                fn()
            samples[key] += _samples(fn, -(-repeats // PASSES))
    return {key: time_stats(ms) for key, ms in samples.items()}


def _samples(fn: Callable[[], Any], repeats: int) -> list[float]:
    ms = []
    for _ in range(repeats):
        t = time.process_time()
        fn()
        ms.append((time.process_time() - t) * 1e3)
    return ms
