"""Whole engine steps on decode-only batches: the time outside the profiled ops."""
from __future__ import annotations

import random
import statistics
import time
from typing import Any

from ..sampling_params import SamplingParams

PROMPT_LEN = 32  # prompts of the engine-step runs: short, so their prefills stay cheap


def profile_steps(engine: Any, grid: dict[str, Any]
                  ) -> tuple[dict[int, tuple[list[float], int]], float, float]:
    """CPU times of `LLMEngine.step()` on decode-only batches: batch -> (seconds of each
    step, mean context); and the wall and CPU seconds of all those steps."""
    rng = random.Random(0)
    vocab = engine.model_config.vocab_size
    out, wall, cpu = {}, 0.0, 0.0
    for b in grid["step_batches"]:
        ids = [f"p{b}-{i}" for i in range(b)]
        for rid in ids:
            engine.add_request(rid, [rng.randrange(100, vocab) for _ in range(PROMPT_LEN)],
                               SamplingParams(max_tokens=10_000, ignore_eos=True, temperature=0))
        while any(r.is_prefill for r in engine.scheduler.running) or engine.scheduler.waiting:
            engine.step()
        engine.step()  # warm-up decode
        ms = []
        for _ in range(grid["step_repeats"]):
            t, c = time.perf_counter(), time.process_time()
            engine.step()
            ms.append(time.process_time() - c)
            wall, cpu = wall + time.perf_counter() - t, cpu + ms[-1]
        ctx = statistics.mean(r.num_computed_tokens for r in engine.scheduler.running)
        out[b] = (ms, int(ctx))
        for rid in ids:
            engine.abort_request(rid)
    return out, wall, cpu
