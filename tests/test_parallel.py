"""Tensor and pipeline parallelism on CPU (gloo): same tokens as one process, real workers.

A small random-weight Qwen2 (q/k/v biases, untied LM head; saved as a Hugging Face
directory with the default model's tokenizer) keeps start-up cheap; one run uses the
default model.
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.bench.systems import free_port
from stallfree.distributed.channel import SECRET_ENV, new_secret
from stallfree.distributed.distributed_executor import WorkerError

CONFIG = dict(vocab_size=49152, hidden_size=64, intermediate_size=96, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16,
              max_position_embeddings=512, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
              tie_word_embeddings=False)
PROMPTS = [[(7 * i + 3 * j) % 5000 + 10 for j in range(n)]
           for i, n in enumerate((3, 9, 17, 30, 41, 5, 60, 12))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
ENGINE = dict(policy="sarathi", token_budget=16, max_model_len=256, dtype="float32")


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from stallfree.model.tokenizer import load_tokenizer

    torch.manual_seed(0)
    model = Qwen2ForCausalLM(Qwen2Config(**CONFIG))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.1)  # biases too, so a misplaced slice shows
    folder = tmp_path_factory.mktemp("small_qwen2")
    model.save_pretrained(folder, safe_serialization=True)
    load_tokenizer(None).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def single_tokens(small_model) -> list[list[int]]:
    llm = LLM(small_model, **ENGINE)
    return [o.token_ids for o in llm.generate(PROMPTS, GREEDY)]


def _listening_addresses(port: int) -> set[str]:
    """The local addresses of the sockets listening on `port` (from /proc/net/tcp*)."""
    import ipaddress

    found = set()
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        with open(table) as f:
            for line in f.readlines()[1:]:
                local, state = line.split()[1], line.split()[3]
                addr, hex_port = local.split(":")
                if state == "0A" and int(hex_port, 16) == port:  # 0A: LISTEN
                    raw = bytes.fromhex(addr)
                    # /proc writes each 32-bit word in host (little-endian) order.
                    raw = b"".join(raw[i:i + 4][::-1] for i in range(0, width // 2, 4))
                    found.add(str(ipaddress.ip_address(raw)))
    return found


def _overlaps(a, b) -> bool:
    return a.start < b.end and b.start < a.end


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2), (2, 2)])
def test_parallel_greedy_matches_single_process(small_model, single_tokens, tp, pp):
    with LLM(small_model, tensor_parallel_size=tp, pipeline_parallel_size=pp, **ENGINE) as llm:
        outputs = llm.generate(PROMPTS, GREEDY)
        records = list(llm.engine.iterations)
        workers = llm.engine.executor.workers
        procs = list(llm.engine.executor.procs)
        store_port = llm.engine.executor.store.port
        # Every rank is local: the control store listens on loopback alone.
        assert _listening_addresses(store_port) == {"127.0.0.1"}
    assert [o.token_ids for o in outputs] == single_tokens
    assert len(workers) == tp * pp and all(len(r.stage_times) == pp for r in records)
    # Every worker process is gone once the LLM is shut down.
    assert all(p.poll() is not None for p in procs)
    # A request is never in two micro-batches in flight at once.
    for i, a in enumerate(records):
        for b in records[i + 1:]:
            if _overlaps(a, b):
                assert not set(a.request_ids) & set(b.request_ids)


def test_prefix_caching_across_workers_matches_one_process_without_it(small_model):
    """Block tables stay the engine's; the workers' KV is shared by prefix, whether the
    blocks came from another request, the same prompt's first sequence (n = 2) or, with
    micro-batches in flight, only once their batch completed."""
    shared = [(5 * j) % 4000 + 20 for j in range(40)]  # two full blocks, then 8 tokens
    prompts = [shared + [(11 * i + j) % 4000 + 30 for j in range(3 + 4 * i)] for i in range(6)]
    with LLM(small_model, enable_prefix_caching=False, **ENGINE) as llm:
        expected = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    pair_params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, n=2)
    with LLM(small_model, tensor_parallel_size=2, pipeline_parallel_size=2, **ENGINE) as llm:
        first = llm.generate(prompts[:1], GREEDY)  # caches the shared blocks
        rest = llm.generate(prompts[1:], GREEDY)
        pair = llm.generate([prompts[5]], pair_params)[0]
        stats = llm.engine.stats()
    assert [o.token_ids for o in first + rest] == expected
    assert first[0].num_cached_tokens == 0 and all(o.num_cached_tokens == 32 for o in rest)
    assert [s.token_ids for s in pair.outputs] == [expected[5]] * 2
    assert pair.num_cached_tokens == (len(prompts[5]) - 1) // 16 * 16
    assert stats.prefix_cache_hits >= 5 * 32


def test_pipeline_keeps_several_micro_batches_in_flight(small_model, single_tokens):
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    with LLM(small_model, pipeline_parallel_size=2, **ENGINE) as llm:
        llm.generate(prompts, GREEDY)
        records = list(llm.engine.iterations)
        # An abort while its micro-batch is in flight: the others are unaffected.
        engine = llm.engine
        for i in range(3):
            engine.add_request(f"x{i}", PROMPTS[i], GREEDY)
        finished = {out.request_id: out for out in engine.step().finished}
        engine.abort_request("x0")
        while engine.has_unfinished_requests():
            finished.update((out.request_id, out) for out in engine.step().finished)
        assert "x0" not in finished
        assert [finished[f"x{i}"].outputs[0].token_ids for i in (1, 2)] == single_tokens[1:3]
    in_flight = sum(_overlaps(a, b) for a, b in zip(records, records[1:]))
    assert in_flight > len(records) // 2, "micro-batches ran one at a time"
    # The workers' own stage clocks: stage 0 starts batch k+1 before stage 1 ends batch k.
    pipelined = sum(b.stage_times[0][0] < a.stage_times[1][1]
                    for a, b in zip(records, records[1:]))
    assert pipelined > 0


def test_tensor_parallel_weights_are_split(small_model, single_tokens):
    from stallfree.model.loader import load_model

    whole, _ = load_model(small_model, torch.float32, "cpu")
    total = sum(whole.weight_numels().values()) * 4
    with LLM(small_model, tensor_parallel_size=2, **ENGINE) as llm:
        per_rank = [w.weight_bytes for w in llm.engine.executor.workers]
        # A new KV cache size reaches every rank (a tiny one forces preemptions).
        # 6 blocks of 16 tokens; per rank a token is 4 layers x K and V x 1 head x 16 x 4 B.
        llm.reconfigure(kv_cache_memory=6 * 16 * 4 * 2 * 16 * 4)
        assert llm.engine.block_manager.num_total_blocks == 6
        outputs = llm.generate(PROMPTS[:4], GREEDY)
        assert sum(o.outputs[0].num_preemptions for o in outputs) > 0
    # Everything but the small norms is split: each rank holds about half.
    assert all(0.45 * total < b < 0.55 * total for b in per_rank), (per_rank, total)
    assert [o.token_ids for o in outputs] == single_tokens[:4]


def test_worker_crash_fails_the_request(small_model):
    llm = LLM(small_model, tensor_parallel_size=2, **ENGINE)
    procs = llm.engine.executor.procs
    llm.engine.add_request("a", PROMPTS[6], SamplingParams(max_tokens=200, ignore_eos=True))
    llm.engine.step()
    os.kill(procs[1].pid, signal.SIGKILL)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="rank 1"):
        while llm.engine.has_unfinished_requests():
            llm.engine.step()
    assert time.monotonic() - start < 30
    assert all(p.poll() is not None for p in procs), "a worker outlived the failure"


def test_worker_from_another_machine_joins(small_model, single_tokens, monkeypatch):
    """The multi-machine path: rank 1 started by hand with the torch.distributed env."""
    remote = _remote_worker(monkeypatch)
    try:
        with LLM(small_model, tensor_parallel_size=2, num_local_workers=1, **ENGINE) as llm:
            assert [o.token_ids for o in llm.generate(PROMPTS[:3], GREEDY)] == single_tokens[:3]
        assert remote.wait(timeout=30) == 0
    finally:
        if remote.poll() is None:
            remote.kill()


def _remote_worker(monkeypatch) -> subprocess.Popen:
    """Rank 1 of 2, started by hand as on another machine (with the run's secret)."""
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv(SECRET_ENV, new_secret().hex())
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="0")
    return subprocess.Popen([sys.executable, "-m", "stallfree", "worker"], env=env)


def test_a_remote_worker_gone_silent_fails_the_engine(small_model, monkeypatch):
    """A rank that hangs without exiting or reporting (a frozen machine, a cut network):
    its heartbeat stops, and the engine fails instead of waiting forever."""
    remote = _remote_worker(monkeypatch)
    try:
        with LLM(small_model, tensor_parallel_size=2, num_local_workers=1, **ENGINE) as llm:
            llm.generate(PROMPTS[:1], GREEDY)
            os.kill(remote.pid, signal.SIGSTOP)
            with pytest.raises(WorkerError, match="rank 1 sent no heartbeat"):
                llm.generate(PROMPTS[:2], GREEDY)
    finally:
        remote.kill()
        remote.wait(timeout=30)


def test_remote_workers_need_a_secret(small_model, monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv("STALLFREE_WORKER_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match=SECRET_ENV):
        LLM(small_model, tensor_parallel_size=2, num_local_workers=1, **ENGINE)


def test_generate_cli_with_parallel_flags(small_model, single_tokens):
    from stallfree.model.tokenizer import load_tokenizer

    text = load_tokenizer(small_model).decode(PROMPTS[1])
    cmd = [sys.executable, "-m", "stallfree", "generate", "--model", small_model, "-tp", "2",
           "-pp", "2", "--max-tokens", "5", "--ignore-eos", "--json", text]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert '"finish_reason": "length"' in done.stdout


def test_default_model_tp2_pp2_matches(default_llm):
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    expected = [o.token_ids for o in default_llm.generate(prompts, params)]
    with LLM(tensor_parallel_size=2, pipeline_parallel_size=2, token_budget=16,
             max_model_len=256, dtype="float32") as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == expected


def _children(pid: int) -> list[int]:
    """Child processes of every thread of `pid` (workers restarted by the engine thread
    are that thread's children)."""
    children = []
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/children") as f:
                children += [int(p) for p in f.read().split()]
        except FileNotFoundError:  # the thread ended meanwhile
            pass
    return children


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] == "Z"  # a zombie has exited
    except FileNotFoundError:
        return True


def test_server_restarts_crashed_workers_then_exits_when_it_cannot(small_model, tmp_path):
    """A SIGKILLed worker mid-stream: the workers restart, every running request is
    recomputed and every stream ends with the tokens of an undisturbed run. Workers that
    cannot come back (the model is gone): the server exits non-zero, workers and all."""
    import asyncio
    import shutil

    import httpx

    from server_utils import ServerProcess, stream_completion

    model = tmp_path / "model"
    shutil.copytree(small_model, model)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    expected = [o.text for o in LLM(str(model), **ENGINE).generate(PROMPTS, params)]
    server = ServerProcess("--model", str(model), "-tp", "2", "--max-model-len", "256",
                           "--dtype", "float32", "--max-num-batched-tokens", "16",
                           "--served-model-name", "small")
    try:
        workers = _children(server.proc.pid)
        assert len(workers) == 2

        async def scenario() -> list[str]:
            started = [asyncio.Event() for _ in PROMPTS]

            async def stream(i: int) -> str:
                text, finish = await stream_completion(c, {
                    "model": "small", "prompt": PROMPTS[i], "max_tokens": 24,
                    "temperature": 0.0, "ignore_eos": True}, started[i])
                assert finish == "length"
                return text

            async with httpx.AsyncClient(base_url=server.url, timeout=300) as c:
                tasks = [asyncio.create_task(stream(i)) for i in range(len(PROMPTS))]
                await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
                os.kill(workers[1], signal.SIGKILL)  # every stream is mid-way
                return await asyncio.gather(*tasks)

        assert asyncio.run(scenario()) == expected
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        metrics = httpx.get(server.url + "/metrics", timeout=10).text
        assert 'stallfree:worker_restarts_total{model_name="small"} 1.0' in metrics
        restarted = _children(server.proc.pid)
        assert len(restarted) == 2 and not set(restarted) & set(workers)
        # Now the workers cannot start again: the server must not linger answering 503.
        shutil.rmtree(model)
        os.kill(restarted[0], signal.SIGKILL)
        assert server.proc.wait(timeout=120) == 1
        assert "workers failed and could not be restarted" in server.log_tail(), server.log_tail()
        deadline = time.monotonic() + 15
        while not all(_gone(w) for w in restarted) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert all(_gone(w) for w in restarted), "a worker outlived the server"
    finally:
        server.stop()
