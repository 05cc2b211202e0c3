"""Structured outputs: the token mask's cost per decode step, grammar compile times, and
the longest iteration while a burst of new grammars compiles.

Run: .venv/bin/python benchmarks/structured_outputs.py [--steps 48] [--rounds 5]

1. Mask cost: `batch` requests all decoding, half of them (one at batch 1) constrained
   by a JSON schema; the time to fill their bitmask rows (engine thread) and to apply
   them (sampler) per step, against the step time, beside the same batch unconstrained.
2. Compile time of every test schema (tests/json_schemas.py), each from a cold cache.
3. A burst of requests with new schemas arriving while 16 requests decode: every
   iteration's time while their grammars compile, beside the same burst once cached.
Every figure is a median (or the stated percentile) of measurements taken in this run.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable

import numpy as np

from stallfree import LLM, SamplingParams
from stallfree.executor import sampler as sampler_module
from stallfree.structured import GrammarCompileService, GrammarMatchers
from stallfree.structured_outputs import StructuredOutputs

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests"))
from json_schemas import SCHEMAS  # noqa: E402

# A constraint that keeps a request decoding for as long as the benchmark needs.
PEOPLE = {"type": "array", "minItems": 200, "items": {
    "type": "object", "properties": {
        "name": {"type": "string", "maxLength": 30},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "city": {"enum": ["Paris", "Oslo", "Lima", "Pune"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1}},
    "required": ["name", "age", "city", "score"], "additionalProperties": False}}


class MaskTimer:
    """Wall time spent filling and applying bitmasks, as (start, seconds) events."""

    def __init__(self) -> None:
        self.events: list[tuple[float, float]] = []
        self._patched: list[tuple[object, str, Callable]] = []

    def _wrap(self, owner: object, name: str) -> None:
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            start = time.monotonic()
            try:
                return original(*args, **kwargs)
            finally:
                self.events.append((start, time.monotonic() - start))
        setattr(owner, name, timed)
        self._patched.append((owner, name, original))

    def __enter__(self) -> MaskTimer:
        self._wrap(GrammarMatchers, "fill_bitmask")
        self._wrap(sampler_module, "_apply_bitmask")
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, original in reversed(self._patched):
            setattr(owner, name, original)

    def within(self, start: float, end: float) -> float:
        return sum(s for t, s in self.events if start <= t <= end)


def _chat(llm: LLM, text: str) -> list[int]:
    return llm.apply_chat_template([{"role": "user", "content": text}])


def mask_cost(llm: LLM, batch: int, steps: int, repeats: int = 2) -> dict[str, float]:
    """Median decode step with `constrained` of `batch` requests masked, and without; the
    two alternate `repeats` times so that load from other processes hits both alike."""
    constrained = 1 if batch == 1 else batch // 2
    prompts = [_chat(llm, f"List people, as JSON. ({i})") for i in range(batch)]
    free = SamplingParams(temperature=0.0, max_tokens=steps, ignore_eos=True)
    masked = SamplingParams(temperature=0.0, max_tokens=steps,
                            structured_outputs={"json": PEOPLE})
    walls: dict[str, list[float]] = {"free": [], "masked": []}
    cpus: dict[str, list[float]] = {"free": [], "masked": []}
    mask: list[float] = []
    for _ in range(repeats):
        for label, count in (("free", 0), ("masked", constrained)):
            params = [masked] * count + [free] * (batch - count)
            llm.engine.iterations.clear()
            with MaskTimer() as timer:
                outs = llm.generate(prompts, params)
            assert all(len(o.token_ids) == steps for o in outs), "a request ended early"
            decodes = [r for r in llm.engine.iterations
                       if r.num_prefill_tokens == 0 and r.num_seqs == batch]
            walls[label] += [r.end - r.start for r in decodes]
            cpus[label] += [r.cpu_time for r in decodes]
            if count:
                mask += [timer.within(r.start, r.end) for r in decodes]
    result = {f"{k}_step_ms": 1000 * statistics.median(v) for k, v in walls.items()}
    result.update({f"{k}_cpu_ms": 1000 * statistics.median(v) for k, v in cpus.items()})
    result["mask_ms"] = 1000 * statistics.median(mask)
    result["mask_share"] = result["mask_ms"] / result["masked_step_ms"]
    return result


def compile_times(llm: LLM, rounds: int) -> tuple[list[float], float]:
    """Seconds from submit to compiled for every schema, each round from a cold cache;
    and the one-off cost of reading the vocabulary (first use of a service)."""
    engine, times, setup = llm.engine, [], []
    for _ in range(rounds):
        service = GrammarCompileService(engine.tokenizer, engine.model_config.vocab_size,
                                        engine.eos_token_ids)
        start = time.perf_counter()
        service.submit(StructuredOutputs(regex="a")).result()  # reads the vocabulary
        setup.append(time.perf_counter() - start)
        for _, schema in SCHEMAS:
            start = time.perf_counter()
            service.submit(StructuredOutputs(json=schema)).result()
            times.append(time.perf_counter() - start)
        service.shutdown()
    return times, statistics.median(setup)


def burst(llm: LLM, nonce: str, copies: int, running: int = 16) -> dict[str, float]:
    """`running` requests decode; then `copies` requests per schema arrive at once, each
    schema made new by `nonce` and its copy number (an unused $comment). Every iteration
    until all of them have run once: while their grammars compile, the scheduler runs
    the others."""
    engine = llm.engine
    free = SamplingParams(temperature=0.0, max_tokens=1000, ignore_eos=True)
    for i in range(running):
        engine.add_request(f"free-{nonce}-{i}", _chat(llm, f"Tell a long story ({i})."), free)
    for _ in range(12):  # everyone prefilled and decoding
        engine.step()
    before = list(engine.iterations)[-8:]
    compiled: list[float] = []
    ids = []
    added = time.monotonic()
    for copy in range(copies):
        for i, (prompt, schema) in enumerate(SCHEMAS):
            params = SamplingParams(temperature=0.0, max_tokens=4, structured_outputs={
                "json": {**schema, "$comment": f"{nonce}-{copy}"}})
            rid = f"json-{nonce}-{copy}-{i}"
            engine.add_request(rid, _chat(llm, prompt), params)
            ids.append(rid)
            future = engine.grammars.submit(params.structured_outputs)  # the same, cached
            future.add_done_callback(lambda _: compiled.append(time.monotonic()))
    build = time.monotonic() - added
    window, started = [], set()
    while not started >= set(ids):  # until every new request has run at least once
        record = engine.step().record
        if record is not None:
            window.append(record)
            started.update(record.request_ids)
    for rid in ids + [f"free-{nonce}-{i}" for i in range(running)]:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()
    walls = [r.end - r.start for r in window]
    return {"before_ms": 1000 * statistics.median(r.end - r.start for r in before),
            "before_cpu_ms": 1000 * statistics.median(r.cpu_time for r in before),
            "requests": len(ids), "window_iterations": len(window),
            "window_median_ms": 1000 * statistics.median(walls),
            "window_max_ms": 1000 * max(walls),
            "window_max_cpu_ms": 1000 * max(r.cpu_time for r in window),
            "compiling_s": max(compiled) - added,
            "build_ms": 1000 * build}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--steps", type=int, default=48, help="decode steps per mask run")
    parser.add_argument("--rounds", type=int, default=5, help="cold compiles per schema")
    parser.add_argument("--copies", type=int, default=5,
                        help="new grammars per schema in the burst")
    args = parser.parse_args()
    llm = LLM(max_model_len=2048)
    llm.reconfigure(token_budget=512, max_num_seqs=64, kv_cache_memory=None)

    print("## mask cost per decode step (JSON schema; half the batch constrained)")
    print("| batch | constrained | step, none (ms) | step, masked (ms) | CPU, none (ms) | "
          "CPU, masked (ms) | mask (ms) | mask / step |\n|---|---|---|---|---|---|---|---|")
    for batch in (1, 32):
        r = mask_cost(llm, batch, args.steps)
        print(f"| {batch} | {1 if batch == 1 else batch // 2} | {r['free_step_ms']:.1f} | "
              f"{r['masked_step_ms']:.1f} | {r['free_cpu_ms']:.1f} | {r['masked_cpu_ms']:.1f} | "
              f"{r['mask_ms']:.2f} | {100 * r['mask_share']:.1f}% |")

    times, setup = compile_times(llm, args.rounds)
    ms = np.array(times) * 1000
    print(f"\n## compile time, {len(SCHEMAS)} schemas x {args.rounds} cold rounds")
    print(f"median {np.median(ms):.1f} ms, P99 {np.percentile(ms, 99):.1f} ms, "
          f"max {ms.max():.1f} ms; reading the vocabulary once: {1000 * setup:.0f} ms")

    print(f"\n## a burst of {args.copies * len(SCHEMAS)} requests with new schemas "
          f"(16 requests decoding)")
    print("| grammars | iterations until all ran | before: median (ms) | during: median (ms) "
          "| during: longest (ms) | longest, CPU (ms) | compiles done after (s) | "
          "grammar builds in add_request (ms) |\n|---|---|---|---|---|---|---|---|")
    nonce = uuid.uuid4().hex
    for label in ("new (compiling)", "cached"):
        r = burst(llm, nonce, args.copies)
        print(f"| {label} | {r['window_iterations']} | {r['before_ms']:.1f} | "
              f"{r['window_median_ms']:.1f} | {r['window_max_ms']:.1f} | "
              f"{r['window_max_cpu_ms']:.1f} | {r['compiling_s']:.2f} | {r['build_ms']:.1f} |")


if __name__ == "__main__":
    main()
