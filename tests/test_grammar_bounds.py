"""Hostile constraints: the mask holds at any temperature, compiles are bounded in time
and size and cancelled with their request, and the compiled-grammar cache is bounded."""
from __future__ import annotations

import time

import httpx
import pytest
import torch
import xgrammar as xgr

from server_utils import ServerProcess
from stallfree import SamplingParams
from stallfree.executor.sampler import Sampler
from stallfree.model.tokenizer import load_tokenizer
from stallfree.request import Request
from stallfree.structured import GrammarCompileService, build_grammar
from stallfree.structured_outputs import CompileLimits, ConstraintError, StructuredOutputs

# Compiles for seconds to minutes (~100 s on a 2-core EPYC), built in 0.2 s: a compile
# still running whenever a test looks.
HUGE_ENUM = {"enum": [f"value-{i:06d}" for i in range(150_000)]}
ROOMY = CompileLimits(max_constraint_bytes=8 << 20, max_grammar_compile_seconds=600,
                      max_grammar_bytes=4 << 30)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(None)


@pytest.fixture(scope="module")
def service(tokenizer):
    svc = GrammarCompileService(tokenizer, len(tokenizer), frozenset({2}), limits=ROOMY)
    yield svc
    svc.shutdown()


@pytest.fixture
def limits(service):
    """Sets the shared service's limits for one test."""
    def set_limits(**fields) -> None:
        service.limits = CompileLimits(**{**ROOMY.__dict__, **fields})
    yield set_limits
    service.limits = ROOMY


def _idle(service) -> None:
    _until(lambda: (s := service.stats()).compiling == 0 and s.running == 0, "no compile left")


def _until(condition, what: str, timeout: float = 120) -> None:
    """Waits for `condition` (a guard against hanging, not a timing assertion)."""
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"never: {what}"
        time.sleep(0.02)


# ---- the mask holds at every temperature ---------------------------------------------
@pytest.mark.parametrize("temperature", [1e300, 3.5e38, 3.4e38, 1e30])
@pytest.mark.parametrize("extra", [{}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}])
def test_a_huge_temperature_keeps_the_mask(temperature, extra):
    vocab = 100
    logits = torch.randn(2, vocab, generator=torch.Generator().manual_seed(0))
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    bitmask.zero_()
    allowed = {5, 70}
    for t in allowed:
        bitmask[0, t // 32] |= 1 << (t % 32)
    requests = [Request(rid, [1, 2], SamplingParams(temperature=temperature, **extra), 0.0,
                        eos_token_ids=frozenset({0})) for rid in ("masked", "free")]
    picked = [Sampler(seed=seed)(logits, requests, bitmask, {"masked": 0})
              for seed in range(40)]
    assert {masked for masked, _ in picked} == allowed  # uniform over the allowed: both
    assert len({free for _, free in picked}) > 2  # unmasked: anything, no NaN row


# ---- what cannot be enforced is refused -----------------------------------------------
@pytest.mark.parametrize("schema", [
    {"$ref": "http://example.com/person.json"},
    {"type": "object", "properties": {"a": {"$ref": "other.json#/$defs/a"}}},
    {"type": "array", "items": {"$ref": 5}},
])
def test_an_external_ref_is_refused_naming_the_field(schema):
    with pytest.raises(ConstraintError) as err:
        build_grammar(StructuredOutputs(json=schema, source="response_format.json_schema"
                                                            ".schema"))
    assert err.value.param == "response_format.json_schema.schema" and "$ref" in str(err.value)


def test_a_local_ref_still_compiles():
    build_grammar(StructuredOutputs(json={"$ref": "#/$defs/a",
                                          "$defs": {"a": {"type": "integer"}}}))


# ---- compiles: bounded, cancellable, never in the way of the others ------------------
def test_a_simple_compile_finishes_while_a_huge_one_runs(service):
    huge = service.submit(StructuredOutputs(json=HUGE_ENUM))
    simple = service.submit(StructuredOutputs(regex="[0-9]{3}"))
    assert isinstance(simple.result(timeout=120), xgr.CompiledGrammar)
    assert not huge.done()  # it waited for its own compile only, not the huge one's
    huge.cancel()
    _idle(service)


def test_a_compile_no_one_waits_for_is_stopped(service):
    before = service.stats()
    huge = service.submit(StructuredOutputs(json=HUGE_ENUM))
    _until(lambda: service.stats().running == 1, "the huge compile runs")
    huge.cancel()  # its request left: the compile process is killed
    _idle(service)
    simple = service.submit(StructuredOutputs(regex="[0-9]{4}"))
    assert isinstance(simple.result(timeout=120), xgr.CompiledGrammar)
    after = service.stats()
    assert {k: after.compiles[k] - n for k, n in before.compiles.items()} == {
        "compiled": 1, "refused": 0, "cancelled": 1, "failed": 0}
    assert after.entries == before.entries + 1  # the simple one: nothing of the huge one


def test_a_shared_compile_goes_on_while_one_request_still_waits(service):
    spec = StructuredOutputs(regex="(yes|no)!")
    first, second = service.submit(spec), service.submit(spec)
    first.cancel()
    assert isinstance(second.result(timeout=120), xgr.CompiledGrammar)


def test_a_compile_past_its_time_bound_is_refused_naming_the_flag(service, limits):
    limits(max_grammar_compile_seconds=1)
    spec = StructuredOutputs(json={**HUGE_ENUM, "title": "timed"},
                             source="response_format.json_schema.schema")
    err = service.submit(spec).exception(timeout=120)
    assert isinstance(err, ConstraintError)
    assert err.param == "response_format.json_schema.schema"
    assert "--max-grammar-compile-seconds" in str(err)
    refused = service.stats().compiles["refused"]
    again = service.submit(spec)  # refused at once, from the cache: no second compile
    assert isinstance(again.exception(timeout=0), ConstraintError)
    assert service.stats().compiles["refused"] == refused


def test_size_bounds_are_refused_naming_their_flags(service, limits):
    limits(max_constraint_bytes=4096, max_grammar_bytes=1 << 10)
    big = StructuredOutputs(choice=[f"option {i}" for i in range(1000)])
    with pytest.raises(ConstraintError, match="--max-constraint-bytes") as err:
        service.check(big)
    assert err.value.param == "structured_outputs.choice"
    wide = service.submit(StructuredOutputs(regex="[a-z]{1,30}"))
    assert "--max-grammar-bytes" in str(wide.exception(timeout=120))


def test_the_cache_stays_within_its_bytes(service, limits):
    limits(grammar_cache_bytes=4 << 10)
    entries = []
    for i in range(6):
        service.submit(StructuredOutputs(regex=f"[0-9]{{{i + 1}}}y")).result(timeout=120)
        stats = service.stats()
        assert stats.bytes <= 4 << 10
        entries.append(stats.entries)
    assert entries[-1] < entries[2] + 3  # the least recently used were dropped


# ---- through the server ----------------------------------------------------------------
def _constrained_server(tiny_model: str, compile_seconds: int) -> ServerProcess:
    return ServerProcess("--model", tiny_model, "--served-model-name", "tiny", "--dtype",
                         "float32", "--max-model-len", "64", "--max-constraint-bytes", "8MiB",
                         "--max-grammar-compile-seconds", str(compile_seconds))


@pytest.fixture(scope="module")
def server(tiny_model):
    proc = _constrained_server(tiny_model, 1)
    yield proc
    proc.stop()


def _grammar_metrics(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {line.split("{")[0].removeprefix("stallfree:"): float(line.rsplit(" ", 1)[1])
            for line in text.splitlines() if line.startswith("stallfree:grammar")
            and 'outcome="' not in line or line.startswith("stallfree:grammar_compiles_total")
            and 'outcome="compiled"' in line}


def test_refused_requests_never_compile(server):
    for i in range(3):  # each too long for --max-model-len 64, each a distinct schema
        schema = {"enum": [f"v{i}-{k}" for k in range(3000)]}
        reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
            "model": "tiny", "prompt": "word " * 100, "max_tokens": 4,
            "response_format": {"type": "json_schema",
                                "json_schema": {"name": "n", "schema": schema}}})
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "prompt"
    metrics = _grammar_metrics(server.url)
    assert metrics["grammar_cache_entries"] == 0 and metrics["grammar_compiles_running"] == 0
    assert metrics["grammar_compiles_total"] == 0


def test_a_compile_past_its_bound_gets_a_400_naming_the_flag(server):
    reply = httpx.post(server.url + "/v1/chat/completions", timeout=120, json={
        "model": "tiny", "messages": [{"role": "user", "content": "pick"}], "max_tokens": 4,
        "stream": True, "response_format": {"type": "json_schema", "json_schema": {
            "name": "n", "schema": HUGE_ENUM}}})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == "response_format.json_schema.schema"
    assert "--max-grammar-compile-seconds" in error["message"]
    fine = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny", "prompt": "n", "max_tokens": 8, "temperature": 1e300,
        "structured_outputs": {"regex": "[0-9]{3}"}})
    assert fine.status_code == 200 and fine.json()["choices"][0]["text"].isdigit()
    assert _grammar_metrics(fine.url.scheme + "://" + fine.url.netloc.decode())[
        "grammar_cache_bytes"] > 0


@pytest.fixture(scope="module")
def patient_server(tiny_model):
    """A server that would let the 150K-value enum compile for a minute."""
    proc = _constrained_server(tiny_model, 60)
    yield proc
    proc.stop()


def _compiles(url: str, outcome: str) -> float:
    text = httpx.get(url + "/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("stallfree:grammar_compiles_total")
               and f'outcome="{outcome}"' in line)


def test_a_client_leaving_during_its_compile_stops_it(patient_server):
    url = patient_server.url
    with pytest.raises(httpx.TimeoutException):  # the client gives up while it compiles
        httpx.post(url + "/v1/completions", timeout=3, json={
            "model": "tiny", "prompt": "pick", "max_tokens": 4,
            "structured_outputs": {"json": HUGE_ENUM}})
    ended = ("cancelled", "refused", "failed", "compiled")
    _until(lambda: sum(_compiles(url, o) for o in ended) == 1, "the compile to end")
    # Stopped as its client left, not by its time bound (a refusal) nor compiled.
    assert _compiles(url, "cancelled") == 1
