"""Per-request TBT SLOs: a request's own `tbt_slo` (SamplingParams, or the extra field of
both OpenAI endpoints) under an engine started with one."""
from __future__ import annotations

import math

import httpx
import openai
import pytest

from scheduler_helpers import make_request
from server_utils import ServerProcess
from stallfree import LLM, SamplingParams
from stallfree.config import SchedulerConfig
from stallfree.scheduler import BlockManager, OnlineCost, make_scheduler
from stallfree.scheduler.cost_fit import BatchFeatures
from test_slo_budget import slo_scheduler

# 10 ms per iteration, 0.1 ms per prefill token, 1 ms per decode.
COST = (0.010, 1e-4, 0.0, 0.001, 0.0)


def run(sched, iterations: int, log: list) -> None:
    for it in range(iterations):
        out = sched.schedule(float(it))
        decoding = {c.request_id for c in out.chunks if not c.is_prefill}
        prefill = sum(c.num_tokens for c in out.chunks if c.is_prefill)
        log.append((decoding, prefill, out.predicted_time))
        sched.update(out, {c.request_id: 7 for c in out.chunks if c.samples}, float(it))


@pytest.mark.parametrize("value", [-1.0, 0, "0.1", math.nan, math.inf, True])
def test_bad_request_slos_are_rejected_naming_the_field(value):
    with pytest.raises(ValueError, match="tbt_slo"):
        SamplingParams(tbt_slo=value)


def test_the_tightest_slo_among_the_decodes_sets_the_iteration():
    sched = slo_scheduler(1.0, OnlineCost(COST))  # the engine's own target: 0.8 s
    sched.add_request(make_request("tight", 8, max_tokens=10, tbt_slo=0.025))  # 20 ms
    log: list = []
    run(sched, 1, log)  # its prefill; from now on it decodes
    sched.add_request(make_request("long", 1900, max_tokens=2))
    run(sched, 40, log)
    with_tight = [(p, t) for d, p, t in log if "tight" in d]
    without = [p for d, p, _ in log if "tight" not in d and p]
    assert len(with_tight) == 9
    # 20 ms less 10 ms fixed and the decode's 1 ms leaves 90 prefill tokens.
    assert all(t <= 0.020 + 1e-12 for _, t in with_tight)
    assert [p for p, _ in with_tight[:5]] == [90] * 5  # the long prompt still progresses
    assert without and max(without) > 90  # once it is done, the engine's target again


def test_a_request_is_admitted_only_where_its_own_slo_fits():
    sched = slo_scheduler(1.0, OnlineCost(COST))
    for i in range(12):
        sched.add_request(make_request(f"r{i}", 4, max_tokens=100))
    run(sched, 3, [])
    assert sched.num_running == 12
    # 12 decodes + it: 10 + 13 x 1 = 23 ms > its 20 ms: it waits, the others decode on.
    sched.add_request(make_request("tight", 4, max_tokens=5, tbt_slo=0.025))
    log: list = []
    run(sched, 20, log)
    assert sched.num_waiting == 1 and all("tight" not in d for d, _, _ in log)
    assert all(len(d) == 12 for d, _, _ in log)


def test_an_unreachable_request_slo_is_refused_on_arrival():
    sched = slo_scheduler(1.0, OnlineCost(COST))
    with pytest.raises(ValueError, match=r"tbt_slo=0.005 s is unreachable"):
        sched.add_request(make_request("a", 4, tbt_slo=0.005))  # one token: 11 ms
    assert not sched.has_unfinished_requests()


def test_a_fixed_budget_engine_refuses_a_request_slo():
    config = SchedulerConfig(policy="sarathi", token_budget=64, max_model_len=256)
    sched = make_scheduler(config, BlockManager(64, 16, 0.0))
    with pytest.raises(ValueError, match="--tbt-slo"):
        sched.add_request(make_request("a", 4, tbt_slo=0.5))


def test_the_engine_keeps_a_request_slo(tiny_model):
    settings = dict(dtype="float32", max_model_len=128, kv_cache_memory=1 << 20, block_size=8)
    prompts = [[1 + i for i in range(n)] for n in (5, 90)]
    greedy = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    with LLM(tiny_model, **settings) as plain:
        expected = [o.token_ids for o in plain.generate(prompts, SamplingParams(**greedy))]
        with pytest.raises(ValueError, match="--tbt-slo"):
            plain.generate(prompts[:1], SamplingParams(tbt_slo=1.0, **greedy))
    with LLM(tiny_model, tbt_slo=5.0, **settings) as llm:
        outs = llm.generate(prompts, [SamplingParams(tbt_slo=2.0, **greedy),
                                      SamplingParams(**greedy)])
        assert [o.token_ids for o in outs] == expected  # only the batching may change
        records = list(llm.engine.iterations)
        one_token = llm.engine.cost.predict(BatchFeatures().with_chunk(0, 1))
        assert all(r.predicted_time <= max(2.0 * 0.8, one_token) for r in records)


@pytest.fixture(scope="module")
def slo_server(tiny_model):
    proc = ServerProcess("--model", tiny_model, "--served-model-name", "tiny", "--dtype",
                         "float32", "--max-model-len", "128", "--tbt-slo", "5")
    yield proc
    proc.stop()


@pytest.mark.parametrize("path, body", [
    ("/v1/completions", {"prompt": "hello"}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hello"}]}),
])
def test_both_endpoints_take_a_request_slo(slo_server, path, body):
    client = openai.OpenAI(base_url=slo_server.url + "/v1", api_key="unused", max_retries=0)
    create = (client.completions.create if "chat" not in path
              else client.chat.completions.create)
    out = create(model="tiny", max_tokens=4, extra_body={"tbt_slo": 2.5}, **body)
    assert out.usage.completion_tokens == 4
    for value, says in ((-1, "tbt_slo"), ("fast", "tbt_slo"), (1e-9, "unreachable")):
        r = httpx.post(slo_server.url + path, json={"model": "tiny", "max_tokens": 4,
                                                     "tbt_slo": value, **body}, timeout=60)
        assert r.status_code == 400, r.text
        assert says in r.json()["error"]["message"] + str(r.json()["error"].get("param"))
