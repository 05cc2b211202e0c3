"""What every executor offers the engine, and what a batch gives back."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from ..outputs import PromptLogprobs, TokenLogprobs
from ..scheduler.output import SchedulerOutput


class WorkerError(RuntimeError):
    """A worker failed or exited; the executor cannot go on until restarted."""


@dataclass
class RunnerOutput:
    sampled: dict[str, int] = field(default_factory=dict)  # request id -> new token
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # where requested
    # (start, end) of this batch on each pipeline stage, monotonic clock; empty in-process.
    stage_times: list[tuple[float, float]] = field(default_factory=list)
    # Requests whose sampling raised (request id -> reason); the batch's others sampled.
    failed: dict[str, str] = field(default_factory=dict)
    # Request id -> the prompt logprobs its chunk computed, where asked for.
    prompt_logprobs: dict[str, PromptLogprobs] = field(default_factory=dict)


class Executor(Protocol):
    """Runs scheduled batches on the model, wherever its weights live.

    `submit` starts a batch and `receive` returns the oldest unfinished one's result,
    so an executor with `depth` > 1 (pipeline stages) overlaps up to `depth` batches.
    """

    depth: int  # micro-batches in flight at most (the pipeline's stages)
    restartable: bool  # whether restart() can bring failed workers back

    def free_memory(self) -> int | None:
        """Accelerator bytes free for the KV cache after the weights (the least over
        ranks); None on CPU."""

    def reset_kv(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> None:
        """(Re)allocates the KV cache (dropping the old one first) in `kv_cache_dtype` (the
        `kv_cache_dtype` setting: auto, the model's dtype, or int8); no batch in flight."""

    def submit(self, output: SchedulerOutput) -> None: ...

    def receive(self) -> RunnerOutput: ...

    def restart(self) -> None:
        """Starts the workers afresh after a failure (KV cache and batches in flight
        lost; reset_kv must follow)."""

    def shutdown(self) -> None:
        """Stops worker processes, if any; the executor is unusable after."""
