"""Soak test: many requests of every kind against a server; nothing may be lost.

Run (loopback, bounded in count and time):
  .venv/bin/python benchmarks/soak.py                     # 10,000 requests, every policy
  .venv/bin/python benchmarks/soak.py --requests 500 --model DIR --policy sarathi vllm
  .venv/bin/python benchmarks/soak.py --url http://127.0.0.1:8000 --pid PID

Clients ask for completions and chats, streamed and not, n up to 4, sometimes
several prompts; 20% of them hang up at a random point (a random abort), 10% send
one of the bad requests below. It checks, per policy: a status for every request
but those the client gave up on before any answer, no 5xx (nor any status a
request of its kind should not get), every accepted request that stayed finished
with the right token count, the server's success and abort counters consistent
with what the clients saw (`reconcile`), every KV block free at the end
(/metrics), resident memory growth after warm-up (--warmup-fraction of the
requests) within --rss-growth-mib, and the engine alive (/health). Exits 1 on
any failure; --json writes the report. docs/reliability.md holds the results.
"""
from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

import httpx

from stallfree.bench.systems import ServerProcess, System
from stallfree.config import POLICIES

PROMPTS = ["Hello", "The capital of France is", "def add(a, b):", "Once upon a time",
           "List three colours:", "1, 2, 3,", "Translate 'cat' to French:", "Why is the sky"]
CHAT = [{"role": "user", "content": p} for p in PROMPTS]
LONG = "word " * 5000  # past any soak server's max_model_len
# (kind, path, body or raw bytes): each must get a 4xx with an OpenAI error body.
BAD_REQUESTS = [
    ("malformed json", "/v1/completions", b'{"prompt": "x",'),
    ("not an object", "/v1/completions", b"[1, 2]"),
    ("empty body", "/v1/completions", b""),
    ("missing prompt", "/v1/completions", {"max_tokens": 2}),
    ("prompt of a dict", "/v1/completions", {"prompt": {"a": 1}}),
    ("max_tokens string", "/v1/completions", {"prompt": "x", "max_tokens": "ten"}),
    ("zero max_tokens", "/v1/completions", {"prompt": "x", "max_tokens": 0}),
    ("negative temperature", "/v1/completions", {"prompt": "x", "temperature": -1}),
    ("top_p 0", "/v1/completions", {"prompt": "x", "top_p": 0}),
    ("n 0", "/v1/completions", {"prompt": "x", "n": 0}),
    ("unknown model", "/v1/completions", {"model": "gpt-9", "prompt": "x"}),
    ("empty prompt", "/v1/completions", {"prompt": ""}),
    ("prompt too long", "/v1/completions", {"prompt": LONG, "max_tokens": 2}),
    ("token id out of vocab", "/v1/completions", {"prompt": [1, 10**9]}),
    ("min_tokens over max_tokens", "/v1/completions",
     {"prompt": "x", "max_tokens": 2, "min_tokens": 5}),
    ("empty stop string", "/v1/completions", {"prompt": "x", "stop": [""]}),
    ("too many prompts", "/v1/completions", {"prompt": ["x"] * 100}),
    ("too many sequences", "/v1/completions", {"prompt": ["x"] * 10, "n": 100}),
    ("stop string too long", "/v1/completions", {"prompt": "x", "stop": ["s" * 1000]}),
    ("too many stop_token_ids", "/v1/completions",
     {"prompt": "x", "stop_token_ids": list(range(200))}),
    ("body too large", "/v1/completions", {"prompt": "x" * (5 << 20)}),
    ("empty messages", "/v1/chat/completions", {"messages": []}),
    ("bad role", "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}),
    ("top_logprobs without logprobs", "/v1/chat/completions",
     {"messages": CHAT[:1], "top_logprobs": 2}),
    ("detokenize out of vocab", "/detokenize", {"tokens": [10**8]}),
    ("tokenize neither field", "/tokenize", {}),
]


@dataclass
class Tally:
    """One policy's run."""

    policy: str
    requests: int = 0
    completed: int = 0  # accepted, kept and finished with the right token count
    disconnected: int = 0  # the client chose to hang up (it may have had its answer first)
    timed_out: int = 0  # of those, plain requests given up on before any answer: no status
    bad_refused: int = 0  # bad requests answered with the right 4xx
    tokens: int = 0
    statuses: Counter = field(default_factory=Counter)
    bad_kinds: set = field(default_factory=set)
    # For `reconcile`: the sequences and prompts of the good requests answered in full,
    # and of those the client cut short (and how many of those prompts were streamed).
    answered_choices: int = 0
    answered_prompts: int = 0
    cut_choices: int = 0
    cut_prompts: int = 0
    cut_stream_prompts: int = 0
    server: dict = field(default_factory=dict)  # the server's counters over the run
    failures: list[str] = field(default_factory=list)
    rss_warm_mib: float | None = None
    rss_end_mib: float | None = None
    seconds: float = 0.0

    def fail(self, message: str) -> None:
        if len(self.failures) < 50:
            self.failures.append(message)

    def ended(self, choices: int, prompts: int, answered: bool, streamed: bool) -> None:
        """A good request is over for the client: answered in full, or cut short."""
        if answered:
            self.answered_choices += choices
            self.answered_prompts += prompts
        else:
            self.cut_choices += choices
            self.cut_prompts += prompts
            self.cut_stream_prompts += prompts if streamed else 0


async def good_request(client: httpx.AsyncClient, rng: random.Random, tally: Tally,
                       leave: bool) -> None:
    chat = rng.random() < 0.4
    stream = rng.random() < 0.5
    n = rng.choice([1, 1, 2, 4])
    max_tokens = rng.randint(1, 12)
    exact = rng.random() < 0.7  # ignore_eos: exactly max_tokens tokens per sequence
    body: dict = {"max_tokens": max_tokens, "n": n, "ignore_eos": exact, "stream": stream,
                  "temperature": rng.choice([0.0, 0.8]), "seed": rng.randint(0, 99)}
    if chat:
        path, body["messages"] = "/v1/chat/completions", [rng.choice(CHAT)]
        prompts = 1
    else:
        prompts = rng.choice([1, 1, 1, 2])
        path = "/v1/completions"
        body["prompt"] = rng.choice(PROMPTS) if prompts == 1 else rng.sample(PROMPTS, prompts)
    if stream:
        body["stream_options"] = {"include_usage": True}
    choices = prompts * n
    if leave:  # hang up after a random number of chunks (streams) or seconds (plain)
        tally.disconnected += 1
        if stream:
            async with client.stream("POST", path, json=body) as r:
                tally.statuses[r.status_code] += 1
                if r.status_code != 200:
                    tally.fail(f"{path} stream: {r.status_code} {(await r.aread())[:200]!r}")
                    return
                stop_after = rng.randint(0, choices * max_tokens)  # 0: before any chunk
                seen, answered = 0, False
                if stop_after:
                    async for line in r.aiter_lines():
                        seen += line.startswith("data: ")
                        if seen >= stop_after:
                            break
                    else:
                        answered = True  # the stream ended first
            tally.ended(choices, prompts, answered, streamed=True)
            return
        try:
            r = await asyncio.wait_for(client.post(path, json=body), rng.uniform(0.0, 0.3))
        except asyncio.TimeoutError:
            tally.timed_out += 1
            tally.ended(choices, prompts, answered=False, streamed=False)
            return
        tally.statuses[r.status_code] += 1
        if r.status_code != 200:
            tally.fail(f"{path} (left, answered first): {r.status_code} {r.text[:200]}")
            return
        tally.ended(choices, prompts, answered=True, streamed=False)
        return
    if stream:
        counts: Counter = Counter()
        usage, finishes = None, {}
        async with client.stream("POST", path, json=body) as r:
            tally.statuses[r.status_code] += 1
            if r.status_code != 200:
                tally.fail(f"{path} stream: {r.status_code} {(await r.aread())[:200]!r}")
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    tally.fail(f"{path} stream error: {chunk['error']}")
                    return
                usage = chunk.get("usage") or usage
                for c in chunk["choices"]:
                    if c.get("delta", {}).get("role"):
                        continue  # the chat's opening role chunk carries no token
                    counts[c["index"]] += 1  # one chunk per generated token
                    if c["finish_reason"]:
                        finishes[c["index"]] = c["finish_reason"]
        per_choice = [counts[i] for i in range(choices)]
        total = usage["completion_tokens"] if usage else None
        tally.ended(choices, prompts, answered=True, streamed=True)
    else:
        r = await client.post(path, json=body)
        tally.statuses[r.status_code] += 1
        if r.status_code != 200:
            tally.fail(f"{path}: {r.status_code} {r.text[:200]}")
            return
        tally.ended(choices, prompts, answered=True, streamed=False)
        out = r.json()
        finishes = {c["index"]: c["finish_reason"] for c in out["choices"]}
        total = out["usage"]["completion_tokens"]
        per_choice = None
    if sorted(finishes) != list(range(choices)) or not all(
            f in ("stop", "length") for f in finishes.values()):
        tally.fail(f"{path}: choices {sorted(finishes)} finished {finishes}, wanted {choices}")
        return
    if per_choice is not None and total != sum(per_choice):
        tally.fail(f"{path}: usage says {total} tokens, the stream carried {sum(per_choice)}")
        return
    if exact and total != choices * max_tokens:
        tally.fail(f"{path}: {total} tokens for {choices} x max_tokens {max_tokens} (ignore_eos)")
        return
    if not exact and not total <= choices * max_tokens:
        tally.fail(f"{path}: {total} tokens exceed {choices} x max_tokens {max_tokens}")
        return
    tally.completed += 1
    tally.tokens += total


_NEXT_BAD = itertools.count()  # in turn, so that every kind is tried, across policies too


async def bad_request(client: httpx.AsyncClient, tally: Tally) -> None:
    kind, path, body = BAD_REQUESTS[next(_NEXT_BAD) % len(BAD_REQUESTS)]
    kwargs = ({"content": body, "headers": {"content-type": "application/json"}}
              if isinstance(body, bytes) else {"json": body})
    r = await client.post(path, **kwargs)
    tally.statuses[r.status_code] += 1
    tally.bad_kinds.add(kind)
    if not 400 <= r.status_code < 500 or "error" not in r.json():
        tally.fail(f"bad request {kind!r}: {r.status_code} {r.text[:200]}")
        return
    tally.bad_refused += 1


def rss_mib(pid: int | None) -> float | None:
    if pid is None:
        return None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    return None


def metrics(url: str) -> dict[str, float]:
    """The server's stallfree:* samples by name, summed over label sets (the success
    counter has one per finish reason)."""
    values: dict[str, float] = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line.startswith("stallfree:") and " " in line:
            name, value = line.rsplit(" ", 1)
            name = name.split("{")[0]
            values[name] = values.get(name, 0.0) + float(value)
    return values


async def soak(url: str, pid: int | None, tally: Tally, count: int, concurrency: int,
               deadline: float, seed: int, warmup_fraction: float = 0.5) -> None:
    rng = random.Random(seed)
    # The server's native heap (allocator arenas, threads' caches) grows over its first
    # few hundred requests, then stays flat: measured from half-way, growth is a leak.
    warm_at = max(1, int(count * warmup_fraction))
    queue: asyncio.Queue = asyncio.Queue()
    for i in range(count):
        queue.put_nowait(i)

    async def client_loop(client: httpx.AsyncClient) -> None:
        while not queue.empty() and time.monotonic() < deadline:
            i = queue.get_nowait()
            roll = rng.random()
            try:
                if roll < 0.1:
                    await bad_request(client, tally)
                else:
                    await good_request(client, rng, tally, leave=roll < 0.3)
            except (httpx.HTTPError, json.JSONDecodeError, KeyError) as exc:
                tally.fail(f"request {i}: {type(exc).__name__}: {exc}")
            tally.requests += 1
            if tally.requests == warm_at:
                tally.rss_warm_mib = rss_mib(pid)

    async with httpx.AsyncClient(base_url=url, timeout=120, trust_env=False,
                                 limits=httpx.Limits(max_connections=concurrency)) as client:
        await asyncio.gather(*(client_loop(client) for _ in range(concurrency)))


def settle(url: str, tally: Tally, timeout: float = 60) -> None:
    """Waits until the engine is idle; then every KV block must be free and /health 200."""
    end = time.monotonic() + timeout
    while True:
        m = metrics(url)
        idle = m["stallfree:num_requests_running"] == 0 and \
            m["stallfree:num_requests_waiting"] == 0
        if idle or time.monotonic() > end:
            break
        time.sleep(0.2)
    if not idle:
        tally.fail(f"the engine did not go idle: {m}")
    if m["stallfree:kv_cache_free_blocks"] != m["stallfree:kv_cache_total_blocks"]:
        tally.fail(f"KV blocks leaked: {m['stallfree:kv_cache_free_blocks']:.0f} free of "
                   f"{m['stallfree:kv_cache_total_blocks']:.0f}")
    health = httpx.get(url + "/health", timeout=10)
    if health.status_code != 200:
        tally.fail(f"/health answered {health.status_code}: {health.text[:200]}")


# The server's counters reconciled: sequences finished (by any reason), engine requests
# (one per prompt) finished (every finished one has an end-to-end latency), and aborted.
COUNTERS = {"sequences": "stallfree:request_success_total",
            "finished": "stallfree:e2e_request_latency_seconds_count",
            "aborted": "stallfree:request_aborted_total"}


def reconcile(tally: Tally, before: dict[str, float], after: dict[str, float]) -> None:
    """The server's request counters over the run (after settle()) against the clients.

    No equality holds for the requests a client cut short: one may have finished at the
    server first (its last chunks in flight), and a plain one given up on may never have
    reached the engine (no trace at all). What must hold: everything answered in full
    finished, sequence by sequence, and nothing finished beyond those and the cut ones;
    each cut prompt finished or was aborted at most once; and each prompt of a cut
    stream (admitted before its first byte was sent) did one or the other. Bad requests
    leave no trace: they are refused before the engine tracks them.
    """
    got = {k: after.get(name, 0.0) - before.get(name, 0.0) for k, name in COUNTERS.items()}
    tally.server = got
    t = tally
    if not t.answered_choices <= got["sequences"] <= t.answered_choices + t.cut_choices:
        t.fail(f"the server finished {got['sequences']:.0f} sequences; the clients had "
               f"{t.answered_choices} in full and cut {t.cut_choices} short")
    cut_finished = got["finished"] - t.answered_prompts  # prompts cut, finished all the same
    if cut_finished < 0:
        t.fail(f"the server finished {got['finished']:.0f} requests; the clients had "
               f"{t.answered_prompts} prompts answered in full")
    traces = cut_finished + got["aborted"]
    if not t.cut_stream_prompts <= traces <= t.cut_prompts:
        t.fail(f"of {t.cut_prompts} prompts cut short ({t.cut_stream_prompts} streamed), "
               f"{cut_finished:.0f} finished and {got['aborted']:.0f} were aborted")


def check(tally: Tally, rss_bound: float) -> None:
    recorded, due = sum(tally.statuses.values()), tally.requests - tally.timed_out
    if recorded != due:  # a request that raised has none either (and failed already)
        tally.fail(f"{recorded} statuses for the {due} requests that got an answer "
                   f"({tally.timed_out} more given up on by their clients)")
    server_errors = sum(v for k, v in tally.statuses.items() if k >= 500)
    if server_errors:
        tally.fail(f"{server_errors} answers were 5xx: {dict(tally.statuses)}")
    if tally.rss_warm_mib is not None and tally.rss_end_mib is not None \
            and tally.rss_end_mib - tally.rss_warm_mib > rss_bound:
        tally.fail(f"resident memory grew {tally.rss_end_mib - tally.rss_warm_mib:.0f} MiB "
                   f"after warm-up (bound {rss_bound:.0f})")


def run_policy(args: argparse.Namespace, policy: str, count: int, deadline: float) -> Tally:
    tally = Tally(policy)
    server = None
    url, pid = args.url, args.pid
    if url is None:
        cmd = [sys.executable, "-m", "stallfree", "serve", *([args.model] if args.model else []),
               "--host", "127.0.0.1", "--port", "{port}", "--policy", policy,
               "--max-model-len", str(args.max_model_len), "--uvicorn-log-level", "error",
               *args.server_arg]
        server = ServerProcess(System(f"soak-{policy}", command=cmd,
                                      env={"HF_HUB_OFFLINE": "1"}))
        url, pid = server.base_url, server.proc.pid
    start = time.monotonic()
    try:
        before = metrics(url)  # a running server (--url) has counted other requests
        asyncio.run(soak(url, pid, tally, count, args.concurrency, deadline, args.seed,
                         args.warmup_fraction))
        settle(url, tally)
        reconcile(tally, before, metrics(url))
        tally.rss_end_mib = rss_mib(pid)
        if server is not None and server.proc.poll() is not None:
            tally.fail(f"the server exited with {server.proc.returncode}")
    finally:
        tally.seconds = time.monotonic() - start
        if server is not None:
            server.stop()
    if tally.requests < count:
        tally.fail(f"only {tally.requests} of {count} requests ran within --time-limit")
    check(tally, args.rss_growth_mib)
    return tally


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=10_000, help="in all, split over policies")
    p.add_argument("--policy", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--time-limit", type=float, default=3600.0, help="seconds, in all")
    p.add_argument("--model", default=None, help="for the servers started here")
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--server-arg", action="append", default=[],
                   help="extra `stallfree serve` argument (repeat)")
    p.add_argument("--url", default=None, help="a running server instead (one policy)")
    p.add_argument("--pid", type=int, default=None, help="its pid, for resident memory")
    p.add_argument("--rss-growth-mib", type=float, default=64.0)
    p.add_argument("--warmup-fraction", type=float, default=0.5,
                   help="share of a policy's requests before the RSS baseline is read")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None, help="write the report here")
    args = p.parse_args(argv)
    policies = ["(running server)"] if args.url else args.policy
    deadline = time.monotonic() + args.time_limit
    tallies = []
    for i, policy in enumerate(policies):
        count = args.requests // len(policies) + (i < args.requests % len(policies))
        tallies.append(run_policy(args, policy, count, deadline))
    report = {"ok": not any(t.failures for t in tallies), "command": sys.argv,
              "policies": [{**asdict(t), "statuses": dict(t.statuses),
                            "bad_kinds": sorted(t.bad_kinds)} for t in tallies]}
    for t in tallies:
        print(f"{t.policy}: {t.requests} requests in {t.seconds:.0f} s: {t.completed} completed "
              f"({t.tokens} tokens), {t.disconnected} left early ({t.timed_out} before any "
              f"answer), {t.bad_refused} bad refused ({len(t.bad_kinds)} kinds); statuses "
              f"{dict(sorted(t.statuses.items()))}; server: {t.server}; RSS "
              f"{t.rss_warm_mib or 0:.0f} -> {t.rss_end_mib or 0:.0f} MiB; "
              f"{len(t.failures)} failures")
        for failure in t.failures[:10]:
            print(f"  FAIL {failure}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1, default=str)
    print("soak:", "ok" if report["ok"] else "FAILED")
    return 0 if report["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
