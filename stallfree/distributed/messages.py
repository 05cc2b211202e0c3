"""What the engine and its workers say to each other, as explicit msgspec types.

Nothing here is pickled: each message decodes into the one type its key expects,
checked field by field (sampling parameters re-validate themselves), so a payload can
be wrong but never code. A batch carries per chunk only what a rank computes with:
the chunk's own tokens (a decode sends its last token, not the request), its block
table, and for a chunk that samples, the parameters its sampler reads plus the token
history only when a penalty reads it; and structured outputs' token bitmask, if any.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ..executor.base import RunnerOutput
from ..outputs import PromptLogprobs, TokenLogprobs
from ..sampling_params import SamplingParams
from ..scheduler.output import SchedulerOutput

# Bounds that mean "no limit" (top_k, min_tokens, max_tokens) are capped to this on the
# wire: msgpack carries no int past 64 bits, and no count of tokens ever reaches it.
_NO_LIMIT = 2**63 - 1
_CAPPED = ("top_k", "max_tokens", "min_tokens")

# The engine's signed True under this key asks every rank to stop. Signed like every
# message: anyone who reaches the store can set a key, and a bare one must stop nothing.
STOP_KEY = "stop"


class WorkerConfig(msgspec.Struct, frozen=True):
    """What the engine publishes for every rank under the key "config"."""

    model: str | None
    dtype: str  # torch dtype name, e.g. "float32"
    device_type: str  # "cpu" or "cuda"
    tensor_parallel_size: int
    pipeline_parallel_size: int
    seed: int
    num_threads: int | None  # CPU threads per worker; None leaves torch's default
    # The engine's `kernels` setting (op -> implementation): every rank chooses alike.
    kernels: dict[str, str] = msgspec.field(default_factory=dict)
    quantization: str = "auto"  # the engine's setting (model/quant_load.py)


class WorkerInfo(msgspec.Struct, frozen=True):
    """A rank's report once its shard is loaded (key "ready/<rank>")."""

    rank: int
    pid: int
    host: str
    weight_bytes: int
    free_memory: int | None  # accelerator memory left after the weights; None on CPU


class WireParams(msgspec.Struct, array_like=True):
    """The sampling parameters a rank's sampler reads (SamplingParams' other fields, such
    as stop strings or a structured-output grammar, are the engine's business)."""

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int | None
    max_tokens: int | None
    min_tokens: int
    stop_token_ids: list[int]
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int | None

    @classmethod
    def of(cls, p: SamplingParams) -> WireParams:
        params = cls(*(getattr(p, f) for f in cls.__struct_fields__))
        for name in _CAPPED:
            value = getattr(params, name)
            if value is not None and value > _NO_LIMIT:
                setattr(params, name, _NO_LIMIT)
        return params

    def sampling_params(self) -> SamplingParams:
        """Validated again on the rank: a bad value raises there, never runs."""
        return SamplingParams(**{f: getattr(self, f) for f in self.__struct_fields__})


class WireBitmask(msgspec.Struct, array_like=True):
    """Structured outputs' allowed-token bitmask (int32 rows) and the row of each request."""

    shape: list[int]
    data: bytes
    rows: dict[str, int]


class WireSampling(msgspec.Struct, array_like=True):
    params: WireParams
    num_output_tokens: int
    eos_token_ids: list[int]
    # Only when a penalty reads them (has_penalties); otherwise empty.
    prompt_token_ids: list[int] = []
    output_token_ids: list[int] = []


class WireChunk(msgspec.Struct, array_like=True):
    request_id: str
    start: int
    num_tokens: int
    block_table: list[int]
    token_ids: list[int]
    samples: bool
    sampling: WireSampling | None = None
    # Prompt logprobs: the top alternatives asked for, and the prompt tokens this chunk's
    # positions predict (empty when none were asked for).
    prompt_logprobs: int | None = None
    prompt_logprob_targets: list[int] = []


class KvMessage(msgspec.Struct, tag="kv"):
    """(Re)allocate the KV cache; every rank acknowledges under ack/<index>/<rank>."""

    num_blocks: int
    block_size: int
    kv_cache_dtype: str = "auto"  # the engine's setting (model/kv_quant.py)


class RunMessage(msgspec.Struct, tag="run"):
    """One micro-batch; the last stage's TP rank 0 answers under out/<index>."""

    chunks: list[WireChunk]
    bitmask: WireBitmask | None = None


Message = KvMessage | RunMessage


class RunResult(msgspec.Struct):
    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    failed: dict[str, str] = {}
    prompt_logprobs: dict[str, PromptLogprobs] = {}


# ---- the engine's side ----------------------------------------------------------------
def run_message(output: SchedulerOutput) -> RunMessage:
    chunks = []
    for c in output.chunks:
        sampling = None
        if c.samples:
            r = c.request
            p = r.sampling_params
            history = p.has_penalties
            sampling = WireSampling(WireParams.of(p), r.num_output_tokens,
                                    sorted(r.eos_token_ids),
                                    r.prompt_token_ids if history else [],
                                    r.output_token_ids if history else [])
        chunks.append(WireChunk(c.request_id, c.start, c.num_tokens, c.block_table,
                                c.token_ids, c.samples, sampling, c.prompt_logprobs,
                                c.prompt_logprob_targets))
    # Structured outputs (when the engine has them) constrain sampling with a bitmask.
    mask = getattr(output, "token_bitmask", None)
    bitmask = None if mask is None else WireBitmask(
        list(mask.shape), mask.cpu().contiguous().numpy().tobytes(),
        dict(getattr(output, "bitmask_rows", {})))
    return RunMessage(chunks, bitmask)


def without_unsendable(message: RunMessage) -> tuple[RunMessage, dict[str, str]]:
    """`message` less the chunks that cannot be encoded (a value validation let through
    but msgpack cannot carry, such as an int past 64 bits), and why each failed: their
    requests fail alone, the rest of the batch runs."""
    encoder = msgspec.msgpack.Encoder()
    kept, failed = [], {}
    for chunk in message.chunks:
        try:
            encoder.encode(chunk)
        except (OverflowError, TypeError, ValueError) as exc:
            failed[chunk.request_id] = (f"its parameters cannot be sent to the workers "
                                        f"({type(exc).__name__}: {exc})")
        else:
            kept.append(chunk)
    return RunMessage(kept, message.bitmask), failed


def result_message(output: RunnerOutput) -> RunResult:
    return RunResult(output.sampled, output.logprobs, output.failed, output.prompt_logprobs)


def runner_output(result: RunResult) -> RunnerOutput:
    return RunnerOutput(result.sampled, result.logprobs, failed=result.failed,
                        prompt_logprobs=result.prompt_logprobs)


# ---- the worker's side ----------------------------------------------------------------
@dataclass
class SamplingView:
    """What the sampler reads of a request, rebuilt on a worker from its WireSampling."""

    request_id: str
    sampling_params: SamplingParams
    num_output_tokens: int
    eos_token_ids: frozenset[int]
    prompt_token_ids: list[int]
    output_token_ids: list[int]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids


@dataclass
class WorkerChunk:
    """A chunk as the model runner reads it (the fields of ScheduledChunk it uses)."""

    request_id: str
    start: int
    num_tokens: int
    block_table: list[int]
    token_ids: list[int]
    samples: bool
    request: SamplingView | None
    prompt_logprobs: int | None = None
    prompt_logprob_targets: list[int] = field(default_factory=list)


@dataclass
class WorkerBatch:
    """A batch as the model runner reads it (the fields of SchedulerOutput it uses)."""

    chunks: list[WorkerChunk] = field(default_factory=list)
    token_bitmask: Any = None  # a tensor of int32 rows, or None
    bitmask_rows: dict[str, int] = field(default_factory=dict)


def worker_batch(message: RunMessage) -> WorkerBatch:
    chunks = []
    for c in message.chunks:
        view = None
        if c.sampling is not None:
            s = c.sampling
            view = SamplingView(c.request_id, s.params.sampling_params(), s.num_output_tokens,
                                frozenset(s.eos_token_ids), s.prompt_token_ids,
                                s.output_token_ids)
        chunks.append(WorkerChunk(c.request_id, c.start, c.num_tokens, c.block_table,
                                  c.token_ids, c.samples, view, c.prompt_logprobs,
                                  c.prompt_logprob_targets))
    batch = WorkerBatch(chunks)
    if message.bitmask is not None:
        import torch

        mask = message.bitmask
        batch.token_bitmask = torch.frombuffer(bytearray(mask.data), dtype=torch.int32
                                               ).reshape(mask.shape)
        batch.bitmask_rows = dict(mask.rows)
    return batch
