"""The start-up calibration of the TBT SLO's cost model: a few real batches of known shapes.

Without a `stallfree profile` result the SLO budget needs a first guess of the
iteration time before any request arrives. This runs about a dozen batches on the
executor (prefills with and without cached context, decode batches of a few sizes and
contexts, one mixed batch), times them and fits `OnlineCost`'s coefficients by least
squares; the engine then refines them from every real iteration.

It also times lone prefill chunks of growing sizes (64, 128, 256, 512, 768, 1024, 1536,
...) for the efficient chunk (`cost_fit.efficient_chunk`): the SLO budget never runs
more tokens per iteration than that size, past which a token costs more. On the default
model on one CPU core the whole calibration takes 6-9 s.

The batches use made-up requests over KV blocks that no request owns yet (their
contents are garbage, which costs the same to compute); nothing reaches the
scheduler or the prefix cache.
"""
from __future__ import annotations

import time
from statistics import median

from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler.cost_fit import (
    EFFICIENT_TOLERANCE,
    BatchFeatures,
    OnlineCost,
    efficient_chunk,
    fit_least_squares,
)
from ..scheduler.output import ScheduledChunk, SchedulerOutput
from .base import Executor

_DECODE = 0.0  # as the new tokens of a chunk: one token, a decode
# (new tokens, cached tokens) of each chunk in one probe, as fractions of the longest
# context probed.
_PROBES: tuple[tuple[tuple[float, float], ...], ...] = (
    ((1 / 64, 0.0),),
    ((1 / 4, 0.0),),
    ((1.0, 0.0),),
    ((1 / 8, 7 / 8),),
    ((1 / 64, 0.0),) * 2,
    tuple((_DECODE, 1 / 16) for _ in range(8)),
    tuple((_DECODE, 1.0) for _ in range(8)),
    tuple((_DECODE, 1 / 16) for _ in range(32)),
    tuple((_DECODE, 1.0) for _ in range(2)),
    ((1 / 4, 0.0), *((_DECODE, 1 / 4) for _ in range(8))),
)
_REPEATS = 3  # the median of each probe's times; one extra warm-up run of each first
_LONE_REPEATS = 5  # lone chunks are told apart by ~1%: more runs for their medians
_LONGEST = 512  # tokens of context at most (fewer when the KV cache or model is smaller)


def _probe_batch(shape: tuple[tuple[float, float], ...], longest: int,
                 block_table: list[int]) -> SchedulerOutput:
    chunks = []
    for i, (new, cached) in enumerate(shape):
        num_tokens = 1 if new == _DECODE else max(2, int(new * longest))
        start = min(int(cached * longest), longest - num_tokens)
        request = Request(f"calibration-{i}", [1] * (start + num_tokens),
                          SamplingParams(max_tokens=1, temperature=0.0), 0.0)
        chunks.append(ScheduledChunk(request, start, num_tokens, block_table))
    return SchedulerOutput(chunks)


def _time(executor: Executor, out: SchedulerOutput, runs: int) -> float:
    """The median time of the last `runs` of `runs + 1` runs of batch `out`."""
    times = []
    for _ in range(runs + 1):
        start = time.perf_counter()
        executor.submit(out)
        executor.receive()
        times.append(time.perf_counter() - start)
    return median(times[1:])


def _chunk_sizes(limit: int) -> list[int]:
    """64, 128, 256, 512, 768, 1024, 1536, 2048, 3072, ... below `limit`, then `limit`."""
    sizes = sorted([64, 128] + [m << k for k in range(8, 31) for m in (1, 3)])
    return [n for n in sizes if n < limit] + ([limit] if limit >= 2 else [])


def _lone_chunks(executor: Executor, limit: int, block_size: int) -> dict[int, float]:
    """Seconds of a lone prefill chunk of each size up to `limit`, probed until two sizes
    in a row are no longer within the efficient tolerance of the best time per token."""
    seconds: dict[int, float] = {}
    worse = 0
    for n in _chunk_sizes(limit):
        out = _probe_batch(((1.0, 0.0),), n, list(range(-(-n // block_size))))
        seconds[n] = _time(executor, out, _LONE_REPEATS)
        best = min(t / k for k, t in seconds.items())
        worse = worse + 1 if seconds[n] / n > best * (1 + EFFICIENT_TOLERANCE) else 0
        if worse == 2:
            break
    return seconds


def calibrate(executor: Executor, num_blocks: int, block_size: int, max_model_len: int,
              token_budget: int) -> OnlineCost:
    """Times the probe batches on `executor` (whose KV cache holds `num_blocks` blocks),
    fits the cost model to them and finds the efficient chunk of at most `token_budget`
    tokens."""
    room = min(num_blocks * block_size, max_model_len - 1)
    longest = max(2, min(_LONGEST, room))
    # Every chunk shares one block table: contexts are garbage anyway.
    block_table = list(range(-(-longest // block_size)))
    samples = []
    for shape in _PROBES:
        out = _probe_batch(shape, longest, block_table)
        features = BatchFeatures.of_chunks((c.start, c.num_tokens) for c in out.chunks)
        samples.append((features.vector(), _time(executor, out, _REPEATS)))
    lone = _lone_chunks(executor, min(room, token_budget), block_size)
    return OnlineCost(fit_least_squares(samples), efficient_chunk(lone) if lone else None)
