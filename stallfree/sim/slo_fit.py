"""The TBT SLO's prediction in the simulator: the scheduler's linear model fitted to a cost model.

The scheduler predicts iteration times with `scheduler.cost_fit.OnlineCost` wherever it
runs. In the simulator (and to seed the engine from a `stallfree profile` result) its
coefficients are a least-squares fit to the simulator's cost model over a grid of batch
shapes spanning what the deployment runs: prefill chunks with and without cached
context, decode batches of several sizes and contexts, and mixed batches.
"""
from __future__ import annotations

import itertools

from ..scheduler.cost_fit import BatchFeatures, OnlineCost, efficient_chunk, fit_least_squares
from .cost_model import BatchShape, CostModel

_CHUNKS = (16, 64, 256, 1024, 4096)
_CACHED = (0, 512, 2048)
_BATCHES = (1, 8, 32, 128)
_CONTEXTS = (128, 1024, 4096)
_CHUNK_STEP = 128  # lone chunk sizes probed for the efficient one


def _shapes(max_tokens: int, max_context: int) -> list[BatchShape]:
    chunks = sorted({min(c, max_tokens) for c in _CHUNKS if c > 1} - {1}) or [2]
    contexts = sorted({min(c, max_context) for c in _CONTEXTS})
    cached = sorted({min(c, max_context) for c in _CACHED})
    shapes = [BatchShape.prefill(c, k) for c, k in itertools.product(chunks, cached)]
    shapes += [BatchShape.decode(b, ctx) for b, ctx in itertools.product(_BATCHES, contexts)]
    for c, b in itertools.product(chunks[:3], _BATCHES[1:3]):  # mixed, as sarathi runs them
        decode = BatchShape.decode(b, contexts[len(contexts) // 2])
        shapes.append(BatchShape.of(((c, 0),), decode.decode_contexts, b + 1))
    return shapes


def fit_cost_model(cost: CostModel, max_tokens: int, max_context: int) -> OnlineCost:
    """`OnlineCost` fitted to `cost`'s latency through every stage, for batches of up to
    `max_tokens` tokens per chunk (or the efficient chunk size, if smaller: no larger
    iteration runs) and contexts of up to `max_context` tokens."""
    sizes = range(_CHUNK_STEP, max(max_tokens, _CHUNK_STEP) + 1, _CHUNK_STEP)
    efficient = efficient_chunk(
        {n: cost.iteration(BatchShape.prefill(n)).total(cost.pp) for n in sizes})
    samples = []
    for shape in _shapes(min(max_tokens, efficient), max_context):
        features = BatchFeatures.of_shape(shape.prefills, shape.decode_contexts)
        samples.append((features.vector(), cost.iteration(shape).total(cost.pp)))
    return OnlineCost(fit_least_squares(samples), efficient)
