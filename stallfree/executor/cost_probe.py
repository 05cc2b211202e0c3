"""The start-up calibration of the TBT SLO's cost model: a few real batches of known shapes.

Without a `stallfree profile` result the SLO budget needs a first guess of the
iteration time before any request arrives. This runs about a dozen batches on the
executor (prefills with and without cached context, decode batches of a few sizes and
contexts, one mixed batch), times them and fits `OnlineCost`'s coefficients by least
squares; the engine then refines them from every real iteration. On the default model
on one CPU core it takes a couple of seconds.

The batches use made-up requests over KV blocks that no request owns yet (their
contents are garbage, which costs the same to compute); nothing reaches the
scheduler or the prefix cache.
"""
from __future__ import annotations

import time
from statistics import median

from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler.cost_fit import BatchFeatures, OnlineCost, fit_least_squares
from ..scheduler.output import ScheduledChunk, SchedulerOutput
from .base import Executor

# (new tokens, cached tokens) of each chunk in one probe, as fractions of the longest
# context probed; a chunk of one token is a decode.
_PROBES: tuple[tuple[tuple[float, float], ...], ...] = (
    ((1 / 64, 0.0),),
    ((1 / 4, 0.0),),
    ((1.0, 0.0),),
    ((1 / 8, 7 / 8),),
    ((1 / 64, 0.0),) * 2,
    tuple((1, 1 / 16) for _ in range(8)),
    tuple((1, 1.0) for _ in range(8)),
    tuple((1, 1 / 16) for _ in range(32)),
    tuple((1, 1.0) for _ in range(2)),
    ((1 / 4, 0.0), *((1, 1 / 4) for _ in range(8))),
)
_REPEATS = 3  # the median of each probe's times; one extra warm-up run of each first
_LONGEST = 512  # tokens of context at most (fewer when the KV cache or model is smaller)


def _probe_batch(shape: tuple[tuple[float, float], ...], longest: int,
                 block_table: list[int]) -> SchedulerOutput:
    chunks = []
    for i, (new, cached) in enumerate(shape):
        num_tokens = 1 if new == 1 else max(2, int(new * longest))
        start = min(int(cached * longest), longest - num_tokens)
        request = Request(f"calibration-{i}", [1] * (start + num_tokens),
                          SamplingParams(max_tokens=1, temperature=0.0), 0.0)
        chunks.append(ScheduledChunk(request, start, num_tokens, block_table))
    return SchedulerOutput(chunks)


def calibrate(executor: Executor, num_blocks: int, block_size: int,
              max_model_len: int) -> OnlineCost:
    """Times the probe batches on `executor` (whose KV cache holds `num_blocks` blocks)
    and fits the cost model to them."""
    longest = max(2, min(_LONGEST, num_blocks * block_size, max_model_len - 1))
    # Every chunk shares one block table: contexts are garbage anyway.
    block_table = list(range(-(-longest // block_size)))
    samples = []
    for shape in _PROBES:
        out = _probe_batch(shape, longest, block_table)
        times = []
        for _ in range(_REPEATS + 1):
            start = time.perf_counter()
            executor.submit(out)
            executor.receive()
            times.append(time.perf_counter() - start)
        features = BatchFeatures.of_chunks((c.start, c.num_tokens) for c in out.chunks)
        samples.append((features.vector(), median(times[1:])))
    return OnlineCost(fit_least_squares(samples))
