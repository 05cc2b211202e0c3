"""Schemathesis fuzzing of the server's own OpenAPI schema: no input may cause a 5xx.

Bounded twice: a few examples per operation and mode, and a wall-clock budget per
case after which its remaining examples are skipped (each case has its own, and
must have run some examples: a spent budget cannot pass for a clean run). The
server runs with a short
max_model_len, and the generated n / max_tokens are clamped to small values
(invalid values are left alone), so one example never costs more than a few
engine steps.
"""
from __future__ import annotations

import time

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from schemathesis import GenerationMode

from server_utils import ServerProcess

EXAMPLES = 20  # per operation and generation mode
CASE_BUDGET_S = 15.0  # per operation and mode
MIN_EXAMPLES = 3  # a case with a body that ran fewer tested nothing worth the name


@pytest.fixture(scope="module")
def server():
    proc = ServerProcess("--max-model-len", "64", "--max-num-seqs", "16")
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def schema(server):
    return schemathesis.openapi.from_url(server.url + "/openapi.json")


OPERATIONS = [("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
              ("POST", "/tokenize"), ("POST", "/detokenize"), ("GET", "/v1/models"),
              ("GET", "/health"), ("GET", "/metrics"), ("GET", "/version")]


def _clamp(body: object) -> None:
    """Keeps valid-but-costly knobs small: n <= 2, max_tokens <= 8 (when they are valid ints)."""
    if not isinstance(body, dict):
        return
    for key, cap in (("n", 2), ("max_tokens", 8), ("max_completion_tokens", 8),
                     ("min_tokens", 8), ("best_of", 2)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap


def test_schema_lists_every_operation(schema):
    listed = {(op.ok().method.upper(), op.ok().path) for op in schema.get_all_operations()}
    assert set(OPERATIONS) <= listed


# Negative data needs something to break: only operations that take a body get it.
CASES = [(m, p, GenerationMode.POSITIVE) for m, p in OPERATIONS] + [
    (m, p, GenerationMode.NEGATIVE) for m, p in OPERATIONS if m == "POST"]


@pytest.mark.parametrize("method,path,mode", CASES,
                         ids=[f"{m} {p} {mode.value}" for m, p, mode in CASES])
def test_fuzz_finds_no_server_error(server, schema, method, path, mode):
    operation = schema[path][method]
    seen: list[tuple[int, str]] = []
    deadline = time.monotonic() + CASE_BUDGET_S

    @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=operation.as_strategy(generation_mode=mode))
    def run(case) -> None:
        if time.monotonic() > deadline:
            return
        _clamp(case.body)
        response = case.call(base_url=server.url, timeout=60)
        seen.append((response.status_code, case.as_curl_command()))
        assert response.status_code < 500, (
            f"{response.status_code} for {case.as_curl_command()}:\n{response.text[:1000]}")
        if response.status_code >= 400:
            assert "error" in response.json(), response.text[:500]

    run()
    codes: dict[int, int] = {}
    for code, _ in seen:
        codes[code] = codes.get(code, 0) + 1
    print(f"{method} {path} {mode.value}: status counts {codes}")
    # An operation without parameters has one example to give; the others must run several.
    least = MIN_EXAMPLES if method == "POST" else 1
    assert len(seen) >= least, f"only {len(seen)} examples ran: {codes}"
    # The server survived: still healthy and still generating.
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = httpx.post(server.url + "/v1/completions",
                   json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    assert r.status_code == 200, r.text
