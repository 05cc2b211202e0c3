"""A request that fails on its own (its sampling, its detokenizing) fails alone: the
engine ends it, reports why, and the rest of its batch goes on unchanged."""
from __future__ import annotations

import pytest

from stallfree import LLM, SamplingParams
from stallfree.executor.sampler import Sampler
from stallfree.request_group import RequestGroup

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
PROMPTS = {"a": [11, 12, 13, 14], "bad": [666, 12, 13], "b": [21, 22, 23, 24, 25, 26]}


@pytest.fixture(scope="module")
def llm(tiny_model):
    return LLM(tiny_model, token_budget=64, max_model_len=128, kv_cache_memory=1 << 20)


def _run(llm: LLM) -> tuple[dict[str, list[int]], dict[str, str]]:
    engine = llm.engine
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    done, failed = {}, {}
    while engine.has_unfinished_requests():
        step = engine.step()
        done.update((out.request_id, out.token_ids) for out in step.finished)
        failed.update(step.failed)
    return done, failed


def test_a_request_whose_sampling_raises_fails_alone(llm, monkeypatch):
    clean, failed = _run(llm)
    assert set(clean) == set(PROMPTS) and not failed
    sample = Sampler.__call__

    def flaky(self, logits, requests, *constraints):
        if any(r.prompt_token_ids[0] == 666 and r.num_output_tokens == 3 for r in requests):
            raise RuntimeError("injected sampling failure")
        return sample(self, logits, requests, *constraints)

    monkeypatch.setattr(Sampler, "__call__", flaky)
    done, failed = _run(llm)
    assert set(failed) == {"bad"} and "injected sampling failure" in failed["bad"]
    assert done == {rid: clean[rid] for rid in ("a", "b")}
    engine = llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks


def test_a_request_whose_detokenizing_raises_fails_alone(llm, monkeypatch):
    clean, _ = _run(llm)
    append = RequestGroup.append

    def flaky(self, index, token, logprobs):
        if self.prompt_token_ids[0] == 666:
            raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
        return append(self, index, token, logprobs)

    monkeypatch.setattr(RequestGroup, "append", flaky)
    done, failed = _run(llm)
    assert set(failed) == {"bad"} and "UnicodeDecodeError" in failed["bad"]
    assert done == {rid: clean[rid] for rid in ("a", "b")}
    assert not llm.engine.has_unfinished_requests()


def test_abort_all_leaves_the_engine_usable(llm):
    clean, _ = _run(llm)
    engine = llm.engine
    for rid, prompt in PROMPTS.items():
        engine.add_request(rid, prompt, GREEDY)
    engine.step()
    assert sorted(engine.abort_all()) == sorted(PROMPTS)
    assert not engine.has_unfinished_requests()
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    assert _run(llm) == (clean, {})
