"""The TBT SLO in the real engine, on the tiny random-weight model (float32)."""
from __future__ import annotations

import dataclasses

import pytest

from stallfree import LLM, SamplingParams
from stallfree.iteration_log import IterationLog, read_iteration_log

PROMPTS = [[1 + i for i in range(n)] for n in (3, 40, 90, 7)]
SETTINGS = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 20, block_size=8)


def generate(llm: LLM) -> list[list[int]]:
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
    return [out.token_ids for out in llm.generate(PROMPTS, params)]


def test_greedy_tokens_are_the_same_with_an_slo(tiny_model, tmp_path):
    with LLM(tiny_model, **SETTINGS) as plain:
        expected = generate(plain)
    # A generous SLO (nothing else runs in the test), so only the batching changes.
    with LLM(tiny_model, tbt_slo=5.0, **SETTINGS) as llm:
        assert generate(llm) == expected
        engine = llm.engine
        records = list(engine.iterations)
        assert records and all(r.predicted_time is not None and r.token_budget >= 1
                               for r in records)
        assert engine.cost.num_observed == len(records)  # refined by every iteration
        log = IterationLog(tmp_path / "iterations.jsonl")
        log.write(records[0])
        log.close()
        _, (back,) = read_iteration_log(tmp_path / "iterations.jsonl")
        assert back == dataclasses.replace(records[0], request_ids=())  # ids: not logged


def test_an_unreachable_slo_fails_at_start_up(tiny_model):
    with pytest.raises(ValueError, match="tbt_slo=1e-09 s is unreachable"):
        LLM(tiny_model, tbt_slo=1e-9, **SETTINGS)


def test_the_iteration_log_leaves_the_slo_fields_out_without_one(tmp_path):
    from stallfree.outputs import IterationRecord

    log = IterationLog(tmp_path / "plain.jsonl")
    log.write(IterationRecord(0.0, 1.0, 4, 0, 1, 0, prefill_chunks=((4, 0),)))
    log.close()
    text = (tmp_path / "plain.jsonl").read_text()
    assert "predicted_time" not in text and "token_budget" not in text
