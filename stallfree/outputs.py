"""What the engine hands back to callers."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class TokenLogprobs:
    """Log-probabilities (under the model's raw distribution) at one output step."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # the most likely tokens, best first
    # token_id's place in the distribution (1: the most likely) when it is among `top`.
    rank: int | None = None


@dataclass
class PromptLogprobs:
    """Log-probabilities of the prompt tokens at positions [first, first + len(entries)),
    each given the tokens before it: what one prefill chunk computed."""

    first: int
    entries: list[TokenLogprobs]


@dataclass
class CompletionOutput:
    """One generated sequence (a request with n > 1 has several)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    token_times: list[float] = field(default_factory=list)  # when each token was produced
    num_preemptions: int = 0
    logprobs: list[TokenLogprobs] | None = None  # one per token when requested


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    arrival_time: float
    first_scheduled_time: float | None
    num_cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    # With prompt_logprobs: one entry per prompt token, None for the first (nothing
    # precedes it), as vLLM's RequestOutput.prompt_logprobs.
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finish_reason is not None for o in self.outputs)

    # The first sequence's fields, for the common n == 1 case.
    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> str | None:
        return self.outputs[0].finish_reason

    @property
    def ttft(self) -> float | None:
        """Seconds from arrival to the first token of the first sequence."""
        times = self.outputs[0].token_times
        return times[0] - self.arrival_time if times else None

    @property
    def tbt(self) -> list[float]:
        """Gaps between consecutive tokens of the first sequence, in seconds."""
        times = self.outputs[0].token_times
        return [b - a for a, b in zip(times, times[1:])]


@dataclass
class StepOutput:
    """What one engine step produced for one sequence (streaming granularity)."""

    request_id: str  # the caller's id
    index: int  # which of the n sequences
    new_token_ids: list[int]
    new_text: str
    finish_reason: str | None
    logprobs: list[TokenLogprobs] | None = None  # one per new token when requested
    # The prompt's logprobs (as RequestOutput's), on a request's first step output only.
    prompt_logprobs: list[TokenLogprobs | None] | None = None


def iteration_period(start: float, end: float, next_start: float | None) -> float:
    """How long an iteration held its decodes: from its start to the next iteration's
    start, the handling of its outputs included. A gap longer than the iteration itself
    means the engine sat idle, and without a next iteration (None) only its own time
    (end - start) is known."""
    if next_start is not None and next_start - end < end - start:
        return next_start - start
    return end - start


@dataclass(frozen=True)
class IterationRecord:
    """One engine iteration: what it computed and how long it took.

    The basis of TBT and pipeline analyses, and of checking the simulator's cost
    model against the real engine (`stallfree serve --iteration-log`).
    """

    start: float
    end: float
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_preempted: int
    request_ids: tuple[str, ...] = ()  # the sequences in this (micro-)batch
    # (start, end) on each pipeline stage, from the workers; empty in-process.
    stage_times: tuple[tuple[float, float], ...] = ()
    # The batch as the attention kernel runs it: chunks of several tokens as (new tokens,
    # tokens cached before), and every one-token chunk (a decode, or rarely a prompt's
    # chunk of one) as the tokens it attends to, its new one included.
    prefill_chunks: tuple[tuple[int, int], ...] = ()
    decode_contexts: tuple[int, ...] = ()
    num_sampled: int = 0  # sequences that get a token (decodes and prompts' last chunks)
    # CPU seconds of the engine's thread from scheduling to applying the result: with the
    # model in-process and one intra-op thread, the iteration's compute without the time
    # other processes took from the core.
    cpu_time: float = 0.0
    # Under a TBT SLO: the token budget the SLO gave this iteration, its predicted
    # seconds (to compare with end - start) and the seconds it was held to (the tightest
    # SLO x the margin then, learned or fixed). None under a fixed budget, and then left
    # out of the iteration log.
    token_budget: int | None = None
    predicted_time: float | None = None
    target_time: float | None = None


@dataclass
class StepResult:
    """What one `LLMEngine.step()` did."""

    outputs: list[StepOutput]  # one per sequence that got a token
    # Requests whose every sequence is finished, already released by the engine.
    finished: list[RequestOutput]
    record: IterationRecord | None  # the iteration that completed; None when idle
    # Requests that failed on their own (e.g. in their sampling or detokenizing): id ->
    # reason. The engine has released them; the rest of the batch went on.
    failed: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class EngineStats:
    """The engine's load, for gauges and admission control."""

    num_running: int
    num_waiting: int  # sequences, not caller requests
    kv_usage: float  # fraction of KV blocks in use
    num_free_blocks: int
    num_total_blocks: int
    # Prefix cache, cumulative tokens since the cache was made: needed at admissions, found.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    # Under --tbt-slo: the share of the SLO an iteration's prediction may fill now (learned
    # from the cost model's overruns unless tbt_slo_margin fixed it); None without an SLO.
    tbt_slo_margin: float | None = None


@dataclass(frozen=True)
class EngineInfo:
    """How the engine was set up, for the start-up log, metrics and `generate --json`."""

    device: str
    dtype: str
    dtype_reason: str  # "given", or what the auto choice measured
    threads: int  # compute threads per process
    huge_pages: str = "unknown"  # whether torch's big buffers get 2 MiB pages, and why
    # The kernel table: (op, implementation, why) per op (stallfree/model/kernel_table.py).
    kernels: tuple[tuple[str, str, str], ...] = ()
    # The matmul weights' types and bits per weight ("q4_32 x120 (6 bits/weight), ...").
    weights: str = ""
    # The KV cache's dtype: the model's, or int8 (values and a scale per token and head).
    kv_cache_dtype: str = ""
