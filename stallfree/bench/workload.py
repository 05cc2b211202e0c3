"""Benchmark workloads: request lengths from traces (or random), arrival times, prompt ids.

A workload is a list of `RequestSpec`: when to send a request (seconds after
the start), how many prompt tokens it has and how many output tokens to ask
for. Prompts are random token ids of exactly the wanted length, so that

- the prompt length is the same on every server whatever its tokenizer, and
- no two prompts share a prefix: servers with prefix caching (vLLM, ours)
  get no cache hits that would flatter their prefill figures,

unless the workload repeats on purpose: `shared_prefix_len` starts every prompt
with one system prompt, and `turns` > 1 makes conversations whose later turns
resend the history (`conversations.py`), sent a think time after the previous
turn's reply.

Three seeded random streams are kept apart on purpose: which trace rows are
used (lengths), when requests arrive, and which token ids fill the prompts.
The capacity search re-runs the same requests at several rates: lengths and
the arrival *pattern* stay fixed (inter-arrival gaps are drawn once at unit
rate and divided by the rate), while `token_salt` changes the prompt ids of
each trial so that one trial never warms the prefix cache for the next.
"""
from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..config import option
from .conversations import conversations

TRACE_DIR = Path(__file__).resolve().parent.parent / "data" / "traces"

# `--dataset` name -> file in TRACE_DIR (provenance in TRACE_DIR / "SOURCES.md").
TRACES = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "bwb": "bwb_stats_llama2_tokenizer_filtered_v2.csv",
    "splitwise_conv": "splitwise_conv.csv",
    "splitwise_code": "splitwise_code.csv",
}
DATASETS = (*TRACES, "random")

# SmolLM2's vocabulary (the default model). Ids below MIN_TOKEN_ID are left out
# so that prompts hold no special tokens (SmolLM2 has 17, all below 100).
DEFAULT_VOCAB_SIZE = 49152
DEFAULT_MIN_TOKEN_ID = 100

# Separate seed streams (see the module docstring).
_LENGTHS, _ARRIVALS, _TOKENS, _THINK = 0, 1, 2, 3


@dataclass(frozen=True)
class RequestSpec:
    index: int
    # Seconds after the benchmark starts; for a later turn of a conversation, the
    # conversation's start (it is sent `think_time` after the turn it follows ends).
    arrival: float
    prompt_len: int
    output_len: int  # sent as max_tokens, with ignore_eos
    prompt_token_ids: list[int] = field(repr=False, compare=False)
    turn: int = 0  # 0 for the first turn of a conversation (and every single request)
    follows: int | None = None  # index of the previous turn of its conversation
    think_time: float = 0.0  # seconds from that turn's last token to sending this one


@dataclass
class WorkloadConfig:
    dataset: str = option("sharegpt", "length trace (shipped with stallfree) or random",
                          flags=("--dataset", "--dataset-name"), choices=DATASETS)
    dataset_path: str | None = option(
        None, "a trace CSV with num_prefill_tokens,num_decode_tokens instead")
    num_prompts: int = option(100, "requests in the run")
    request_rate: float = option(math.inf, "requests per second (default inf: all at once)")
    burstiness: float = option(
        1.0, "gamma shape of inter-arrival gaps: 1 = Poisson, < 1 burstier, > 1 more regular")
    seed: int = option(0, "seed of the lengths, the arrivals and the prompt ids")
    length_scale: float = option(
        1.0, "multiply prompt and output lengths (e.g. 0.125 to fit a CPU)")
    max_model_len: int | None = option(
        None, "cap prompt + output, cutting both in proportion (the paper's rule)")
    random_input_len: int = option(1024, "prompt length of the random dataset")
    random_output_len: int = option(128, "output length of the random dataset")
    random_range_ratio: float = option(
        0.0, "random lengths are uniform in len * [1 - r, 1 + r]")
    vocab_size: int = option(DEFAULT_VOCAB_SIZE,
                             "prompt token ids are drawn below this (default: SmolLM2's)")
    min_token_id: int = option(DEFAULT_MIN_TOKEN_ID, "prompt token ids are drawn from this up")
    shared_prefix_len: int = option(
        0, "tokens of one system prompt every prompt starts with (prefix caching)")
    turns: int = option(
        1, "turns per conversation: each later turn resends the previous prompt and reply plus "
           "a new message of the trace's lengths; the request rate is then conversations/s")
    think_time: float = option(
        5.0, "mean seconds (exponential) from a reply to the next turn of its conversation")

    def __post_init__(self) -> None:
        if self.dataset not in DATASETS and self.dataset_path is None:
            raise ValueError(f"dataset must be one of {', '.join(DATASETS)} "
                             f"(or give dataset_path), got {self.dataset!r}")
        if self.num_prompts < 1:
            raise ValueError(f"num_prompts must be >= 1, got {self.num_prompts}")
        if not self.request_rate > 0:
            raise ValueError(f"request_rate must be > 0, got {self.request_rate}")
        if not self.burstiness > 0:
            raise ValueError(f"burstiness must be > 0, got {self.burstiness}")
        if not self.length_scale > 0:
            raise ValueError(f"length_scale must be > 0, got {self.length_scale}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        if not 0 <= self.random_range_ratio < 1:
            raise ValueError(f"random_range_ratio must be in [0, 1), got "
                             f"{self.random_range_ratio}")
        if not 0 <= self.min_token_id < self.vocab_size:
            raise ValueError(f"need 0 <= min_token_id < vocab_size, got {self.min_token_id} "
                             f"and {self.vocab_size}")
        if self.shared_prefix_len < 0:
            raise ValueError(f"shared_prefix_len must be >= 0, got {self.shared_prefix_len}")
        if self.max_model_len is not None and self.max_model_len - self.shared_prefix_len < 2:
            raise ValueError(f"max_model_len {self.max_model_len} leaves no room after the "
                             f"shared prefix of {self.shared_prefix_len} tokens")
        if self.turns < 1:
            raise ValueError(f"turns must be >= 1, got {self.turns}")
        if not self.think_time >= 0:
            raise ValueError(f"think_time must be >= 0, got {self.think_time}")


# ---- lengths -------------------------------------------------------------------
def trace_path(name: str) -> Path:
    if name not in TRACES:
        raise ValueError(f"no trace named {name!r}; known: {', '.join(TRACES)}")
    return TRACE_DIR / TRACES[name]


def load_trace(path: str | os.PathLike) -> list[tuple[int, int]]:
    """(prompt tokens, output tokens) of every row of a trace CSV."""
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"num_prefill_tokens", "num_decode_tokens"} - set(reader.fieldnames or ())
        if missing:
            raise ValueError(f"{path}: missing column(s) {', '.join(sorted(missing))}")
        rows = [(int(float(r["num_prefill_tokens"])), int(float(r["num_decode_tokens"])))
                for r in reader]
    if not rows:
        raise ValueError(f"{path}: no rows")
    return rows


def sample_trace(rows: list[tuple[int, int]], n: int,
                 rng: np.random.Generator) -> list[tuple[int, int]]:
    """The paper's rule: shuffle with a fixed seed, take the first n (reshuffled if n > rows)."""
    out: list[tuple[int, int]] = []
    while len(out) < n:
        order = rng.permutation(len(rows))
        out.extend(rows[i] for i in order[:n - len(out)])
    return out


def random_lengths(n: int, input_len: int, output_len: int, range_ratio: float,
                   rng: np.random.Generator) -> list[tuple[int, int]]:
    """vLLM's `random` dataset: lengths uniform in [len * (1 - r), len * (1 + r)]."""
    def draw(mean: int) -> np.ndarray:
        lo, hi = max(1, int(mean * (1 - range_ratio))), max(1, int(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=n)

    return list(zip(draw(input_len).tolist(), draw(output_len).tolist()))


def scale_lengths(prompt_len: int, output_len: int, scale: float) -> tuple[int, int]:
    """Shrinks (or grows) both lengths by `scale`; each keeps at least one token."""
    return max(1, round(prompt_len * scale)), max(1, round(output_len * scale))


def cap_lengths(prompt_len: int, output_len: int, max_model_len: int | None) -> tuple[int, int]:
    """The paper's rule for over-long requests: cut prompt and output in proportion.

    Floors keep the total within the cap; each part keeps at least one token,
    so the prompt always stays shorter than max_model_len (servers refuse a
    prompt that leaves no room for output).
    """
    total = prompt_len + output_len
    if max_model_len is None or total <= max_model_len:
        return prompt_len, output_len
    factor = max_model_len / total
    p = max(1, math.floor(prompt_len * factor))
    d = max(1, math.floor(output_len * factor))
    while p + d > max_model_len:  # only when a max(1, ...) rounded up
        if p >= d:
            p -= 1
        else:
            d -= 1
    return p, d


def workload_lengths(cfg: WorkloadConfig) -> list[tuple[int, int]]:
    """Scaled and capped (prompt, output) lengths of the workload's requests."""
    rng = np.random.default_rng([cfg.seed, _LENGTHS])
    if cfg.dataset == "random" and cfg.dataset_path is None:
        raw = random_lengths(cfg.num_prompts, cfg.random_input_len, cfg.random_output_len,
                             cfg.random_range_ratio, rng)
    else:
        path = cfg.dataset_path or trace_path(cfg.dataset)
        raw = sample_trace(load_trace(path), cfg.num_prompts, rng)
    # A shared prefix comes on top of each prompt: the cap leaves room for it.
    cap = None if cfg.max_model_len is None else cfg.max_model_len - cfg.shared_prefix_len
    return [cap_lengths(*scale_lengths(p, d, cfg.length_scale), cap) for p, d in raw]


# ---- arrivals --------------------------------------------------------------------
def unit_gaps(n: int, burstiness: float, seed: int) -> np.ndarray:
    """Inter-arrival gaps at rate 1: gamma(shape=B, scale=1/B), so the mean is exactly 1.

    B = 1 is the exponential distribution (a Poisson process); the coefficient
    of variation is 1/sqrt(B).
    """
    rng = np.random.default_rng([seed, _ARRIVALS])
    return rng.gamma(shape=burstiness, scale=1.0 / burstiness, size=n)


def arrival_times(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Arrival times (s) of n requests at mean `rate` per second; inf: all at 0.

    The first request goes at 0 (no idle wait before the run), then n - 1 gaps.
    """
    if math.isinf(rate):
        return [0.0] * n
    gaps = unit_gaps(n, burstiness, seed)
    gaps[0] = 0.0
    return (np.cumsum(gaps) / rate).tolist()


# ---- prompts ------------------------------------------------------------------------
def random_prompt(length: int, rng: np.random.Generator, vocab_size: int,
                  min_token_id: int) -> list[int]:
    return rng.integers(min_token_id, vocab_size, size=length).tolist()


def think_times(n: int, mean: float, seed: int) -> list[float]:
    """Seconds a user takes before each next turn: exponential with the given mean."""
    rng = np.random.default_rng([seed, _THINK])
    return rng.exponential(mean, size=n).tolist() if mean > 0 else [0.0] * n


def build_workload(cfg: WorkloadConfig, token_salt: int = 0) -> list[RequestSpec]:
    """The requests of one run; `token_salt` changes only the prompt ids (see module doc),
    the shared prefix included, so one trial never warms the cache for the next."""
    lengths = workload_lengths(cfg)
    rng = np.random.default_rng([cfg.seed, _TOKENS, token_salt])

    def draw(n: int) -> list[int]:
        return random_prompt(n, rng, cfg.vocab_size, cfg.min_token_id) if n else []

    shared = draw(cfg.shared_prefix_len)
    if cfg.turns == 1:
        arrivals = arrival_times(cfg.num_prompts, cfg.request_rate, cfg.burstiness, cfg.seed)
        return [RequestSpec(i, t, len(shared) + p, d, shared + draw(p))
                for i, (t, (p, d)) in enumerate(zip(arrivals, lengths))]
    sessions = conversations(lengths, cfg.turns, shared, draw, cfg.max_model_len)
    starts = arrival_times(len(sessions), cfg.request_rate, cfg.burstiness, cfg.seed)
    thinks = think_times(len(lengths), cfg.think_time, cfg.seed)
    specs: list[RequestSpec] = []
    for start, session in zip(starts, sessions):
        previous = None
        for turn, (prompt, output_len) in enumerate(session):
            index = len(specs)
            specs.append(RequestSpec(index, start, len(prompt), output_len, prompt, turn,
                                     previous, thinks[index] if turn else 0.0))
            previous = index
    return specs


def describe(specs: list[RequestSpec]) -> dict[str, float]:
    """Summary of a workload's lengths, for the result file."""
    p = np.array([s.prompt_len for s in specs])
    d = np.array([s.output_len for s in specs])
    out = {"num_requests": len(specs), "mean_prompt_len": float(p.mean()),
           "median_prompt_len": float(np.median(p)), "max_prompt_len": int(p.max()),
           "mean_output_len": float(d.mean()), "median_output_len": float(np.median(d)),
           "max_output_len": int(d.max())}
    if any(s.turn for s in specs):
        out["num_conversations"] = sum(1 for s in specs if s.follows is None)
        out["max_turns"] = 1 + max(s.turn for s in specs)
    return out
