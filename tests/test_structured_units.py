"""Structured outputs, piece by piece: constraint checks, grammars, the compile service,
the scheduler's readiness rule, the sampler's mask and the matchers (no model)."""
from __future__ import annotations

import copy
import json
import threading

import pytest
import torch
import xgrammar as xgr

from scheduler_helpers import make_request, new_scheduler, shape, step
from stallfree import SamplingParams
from stallfree.executor.sampler import Sampler
from stallfree.model.tokenizer import load_tokenizer
from stallfree.request import Request
from stallfree.scheduler.output import ScheduledChunk, SchedulerOutput
from stallfree.structured import GrammarCompileService, GrammarMatchers, build_grammar
from stallfree.structured_outputs import ConstraintError, StructuredOutputs


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def service(tokenizer):
    svc = GrammarCompileService(tokenizer, len(tokenizer), frozenset({2}))
    yield svc
    svc.shutdown()


# ---- the constraint as data ---------------------------------------------------------
def _nested(levels: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(levels):
        schema = {"type": "array", "items": schema}
    return schema


@pytest.mark.parametrize("fields,param", [
    ({"json": _nested(70)}, "structured_outputs.json"),  # too deep to build quickly
    ({}, "structured_outputs"),
    ({"regex": "a", "choice": ["a"]}, "structured_outputs"),
    ({"regex": ""}, "structured_outputs.regex"),
    ({"choice": []}, "structured_outputs.choice"),
    ({"choice": ["a", 3]}, "structured_outputs.choice"),
    ({"grammar": 5}, "structured_outputs.grammar"),
    ({"json": "{not json"}, "structured_outputs.json"),
    ({"json": [1, 2]}, "structured_outputs.json"),
    ({"json_object": "yes"}, "structured_outputs.json_object"),
])
def test_malformed_constraints_name_their_field(fields, param):
    with pytest.raises(ConstraintError) as err:
        SamplingParams(structured_outputs=fields)
    assert err.value.param == param and str(err.value).startswith(param)


def test_sampling_params_take_a_dict_or_the_dataclass():
    as_dict = SamplingParams(structured_outputs={"json": '{"type": "integer"}'})
    assert as_dict.structured_outputs == StructuredOutputs(json={"type": "integer"})
    with pytest.raises(ValueError, match="structured_outputs takes the keys"):
        SamplingParams(structured_outputs={"regexp": "a"})
    with pytest.raises(ValueError, match="structured_outputs"):
        SamplingParams(structured_outputs="a+")


def test_the_cache_key_is_the_constraint_text_property_order_kept():
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {}, "b": {}}})
    same = StructuredOutputs(json='{"type": "object", "properties": {"a": {}, "b": {}}}')
    swapped = StructuredOutputs(json={"type": "object", "properties": {"b": {}, "a": {}}})
    assert a.key == same.key != swapped.key
    assert StructuredOutputs(regex="a").key != StructuredOutputs(grammar="a").key


@pytest.mark.parametrize("spec,reason", [
    (StructuredOutputs(json={"type": "foo"}), "foo"),
    (StructuredOutputs(json={"type": "object", "properties": 5}), "properties"),
    (StructuredOutputs(json={"type": "array", "items": {"type": "integer"},
                             "uniqueItems": True}), "uniqueItems"),
    (StructuredOutputs(json={"properties": {"a": {"not": {"type": "integer"}}}}), "not"),
    (StructuredOutputs(regex="(ab"), "parenthesis"),
    (StructuredOutputs(grammar='root ::= "a" | undefined_rule'), "undefined_rule"),
    (StructuredOutputs(grammar='start ::= "a"'), "root"),
    (StructuredOutputs(regex="[0-9]+", source="guided_regex"), None),
])
def test_invalid_grammars_are_refused_naming_the_field(spec, reason):
    if reason is None:
        build_grammar(spec)
        return
    with pytest.raises(ConstraintError) as err:
        build_grammar(spec)
    assert err.value.param == spec.field() and reason in str(err.value)
    assert "/project/" not in str(err.value)  # xgrammar's source locations are dropped


def test_choice_literals_keep_quotes_backslashes_and_newlines(service):
    choices = ['say "hi"', "back\\slash", "two\nlines", "ünï"]
    matcher = xgr.GrammarMatcher(service.submit(StructuredOutputs(choice=choices)).result())
    for choice in choices:
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
        matcher.reset()
    assert not matcher.accept_string("say hi")


# ---- the compile service -------------------------------------------------------------
def test_equal_constraints_share_one_compile_and_bad_ones_fail_at_once(service):
    first = service.submit(StructuredOutputs(regex="[a-c]{2}"))
    again = service.submit(StructuredOutputs(regex="[a-c]{2}"))
    other = service.submit(StructuredOutputs(regex="[a-c]{3}"))
    assert isinstance(first.result(timeout=60), xgr.CompiledGrammar)
    assert first.result() is again.result() is not other.result(timeout=60)
    with pytest.raises(ConstraintError, match="regex"):
        service.submit(StructuredOutputs(regex="[a-"))


# ---- the scheduler skips what is not ready -------------------------------------------
class ThreadNotingTokenizer:
    """Delegates to a tokenizer and notes every thread that reads it; a deep copy is a
    plain copy of the tokenizer, no longer watched."""

    def __init__(self, tokenizer) -> None:
        self.__dict__.update(_tokenizer=tokenizer, threads=set())

    def __getattr__(self, name: str):
        self.threads.add(threading.current_thread().name)
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        self.threads.add(threading.current_thread().name)
        return len(self._tokenizer)

    def __deepcopy__(self, memo: dict):
        self.threads.add(threading.current_thread().name)
        return copy.deepcopy(self._tokenizer, memo)


def test_the_compile_thread_never_reads_the_callers_tokenizer(tokenizer):
    # The engine thread detokenizes with its tokenizer while grammars compile: the
    # service must read only its own copy, or the two threads share one HF tokenizer.
    watched = ThreadNotingTokenizer(tokenizer)
    svc = GrammarCompileService(watched, len(tokenizer), frozenset({2}))
    try:
        svc.submit(StructuredOutputs(regex="(yes|no)!")).result(timeout=120)
    finally:
        svc.shutdown()
    assert watched.threads == {threading.current_thread().name}


def test_an_unready_request_is_skipped_and_joins_once_ready():
    sched = new_scheduler("sarathi", budget=16)
    held = make_request("held", 4)
    held.ready = False
    sched.add_request(held)
    sched.add_request(make_request("free", 4))
    assert sched.has_unfinished_requests() and sched.num_waiting == 1
    out, _ = step(sched)
    assert shape(out) == [("free", 0, 4)]
    out, _ = step(sched)
    assert shape(out) == [("free", 4, 1)]  # still not ready: skipped, nothing waits for it
    held.ready = True
    out, _ = step(sched)
    assert shape(out) == [("free", 5, 1), ("held", 0, 4)]
    assert not sched.unready


def test_an_unready_request_can_be_aborted():
    sched = new_scheduler("vllm", budget=16)
    held = make_request("held", 4)
    held.ready = False
    sched.add_request(held)
    assert sched.abort_request("held") is held and held.is_finished
    assert not sched.has_unfinished_requests()


# ---- the sampler masks only constrained rows -----------------------------------------
def _request(rid: str, **params) -> Request:
    return Request(rid, [1, 2, 3], SamplingParams(**params), 0.0, eos_token_ids=frozenset({0}))


def test_the_mask_changes_constrained_rows_only():
    vocab = 100
    logits = torch.randn(4, vocab, generator=torch.Generator().manual_seed(0))
    requests = [_request("free-greedy", temperature=0), _request("masked", temperature=0),
                _request("free-seeded", temperature=1.0, seed=5),
                _request("masked-seeded", temperature=1.0, seed=6)]
    bitmask = xgr.allocate_token_bitmask(2, vocab)
    bitmask.zero_()
    allowed = {"masked": {17, 42}, "masked-seeded": {3, 64, 99}}
    rows = {"masked-seeded": 0, "masked": 1}  # any order of rows
    for rid, row in rows.items():
        for t in allowed[rid]:
            bitmask[row, t // 32] |= 1 << (t % 32)
    plain = Sampler(seed=1)(logits, requests)
    masked = Sampler(seed=1)(logits, requests, bitmask, rows)
    assert masked[0] == plain[0] and masked[2] == plain[2]  # unconstrained: untouched
    assert masked[1] == max(allowed["masked"], key=lambda t: float(logits[1, t]))
    for seed in range(20):  # sampled rows stay inside their allowed set
        masked = Sampler(seed=seed)(logits, requests, bitmask, rows)
        assert masked[3] in allowed["masked-seeded"]


def test_a_grammar_overrides_min_tokens():
    # The grammar's only continuation is the stop token: min_tokens must not block it.
    logits = torch.zeros(1, 40)
    bitmask = xgr.allocate_token_bitmask(1, 40)
    bitmask.zero_()
    bitmask[0, 0] = 1  # token 0: the eos of _request
    req = _request("r", temperature=0, min_tokens=5)
    assert Sampler()(logits, [req], bitmask, {"r": 0}) == [0]


# ---- matchers follow the request's own outputs ---------------------------------------
def test_matchers_catch_up_with_outputs_and_end_with_the_grammar(service, tokenizer):
    compiled = service.submit(StructuredOutputs(regex="(yes|no)!"))
    request = Request("r", [1, 2], SamplingParams(), 0.0, eos_token_ids=frozenset({2}))
    matchers = GrammarMatchers(len(tokenizer))
    matchers.add(request, compiled)
    assert not request.ready
    compiled.result(timeout=60)
    assert matchers.poll() == [] and request.ready
    text_ids = tokenizer("yes!")["input_ids"]
    request.output_token_ids.extend(text_ids)  # several tokens at once: all are replayed
    assert not matchers.advance("r")
    output = SchedulerOutput([ScheduledChunk(request, 0, request.num_tokens, [0])])
    matchers.fill_bitmask(output)
    row = output.token_bitmask[output.bitmask_rows["r"]]
    allowed = [t for t in range(len(tokenizer)) if row[t // 32] >> (t % 32) & 1]
    assert allowed == [2]  # the regex is complete: only the stop token may follow
    request.output_token_ids.append(2)
    assert matchers.advance("r")  # the grammar has ended: the request must stop


def test_a_failed_compile_is_reported_once(tokenizer):
    from concurrent.futures import Future

    broken: Future = Future()
    broken.set_exception(RuntimeError("out of memory"))
    request = Request("r", [1], SamplingParams(), 0.0)
    matchers = GrammarMatchers(len(tokenizer))
    matchers.add(request, broken)
    assert matchers.poll() == ["r"] and matchers.poll() == []
    assert not request.ready


def test_json_grammar_is_compact(service):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    matcher = xgr.GrammarMatcher(service.submit(StructuredOutputs(json=schema)).result())
    assert matcher.accept_string(json.dumps({"a": 1})) and matcher.is_completed()
    matcher.reset()
    assert not matcher.accept_string('{ "a"')  # no free whitespace to pad with
