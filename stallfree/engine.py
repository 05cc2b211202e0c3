"""LLMEngine: turns requests into tokens, one scheduler iteration per step()."""
from __future__ import annotations

import dataclasses
import time
from collections import deque
from dataclasses import dataclass, field

import torch

from .config import (CacheConfig, EngineConfig, SchedulerConfig, resolve_device,
                     resolve_dtype)
from .detokenizer import IncrementalDetokenizer
from .executor.runner import LocalExecutor, ModelRunner
from .model.llama import kv_cache_bytes_per_token
from .model.loader import load_model, load_model_config
from .model.parallel import Shard
from .model.tokenizer import eos_token_ids, load_tokenizer
from .outputs import (CompletionOutput, IterationRecord, RequestOutput, StepOutput,
                      TokenLogprobs)
from .request import Request, RequestStatus
from .sampling_params import SamplingParams
from .scheduler import make_scheduler
from .scheduler.kv_cache import BlockManager
from .scheduler.output import SchedulerOutput
from .distributed.executor import DistributedExecutor, threads_per_worker
from .distributed.worker import WorkerConfig



@dataclass
class _Group:
    """A caller's request: n sequences generated from one prompt."""

    prompt: str | None
    prompt_token_ids: list[int]
    arrival_time: float
    children: list[Request]
    detokenizers: list[IncrementalDetokenizer]
    stop_hit: list[bool] = field(default_factory=list)
    logprobs: list[list[TokenLogprobs]] = field(default_factory=list)  # per sequence


@dataclass
class _Flight:
    """A submitted micro-batch whose result has not been applied yet."""

    output: SchedulerOutput
    record: IterationRecord
    cpu_start: float  # the engine thread's CPU clock when it was scheduled


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None) -> None:
        self.config = config = config or EngineConfig()
        self.device = torch.device(resolve_device(config.device, torch.cuda.is_available()))
        dtype_name = resolve_dtype(config.dtype, self.device.type)
        self.dtype = getattr(torch, dtype_name)
        parallel = config.parallel
        self.executor: LocalExecutor | DistributedExecutor | None = None
        if parallel.world_size > 1:
            # Weights live in the workers, shard by shard; this process only schedules.
            self.model = None
            self.model_config = load_model_config(config.model)
            Shard(tp_size=parallel.tensor_parallel_size,
                  pp_size=parallel.pipeline_parallel_size).check(
                self.model_config.num_hidden_layers, self.model_config.num_key_value_heads)
            self.executor = DistributedExecutor(WorkerConfig(
                config.model, dtype_name, self.device.type,
                parallel.tensor_parallel_size, parallel.pipeline_parallel_size, config.seed,
                threads_per_worker(parallel.world_size)), parallel)
        else:
            self.model, self.model_config = load_model(config.model, self.dtype, self.device)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        self._in_flight: deque[_Flight] = deque()
        self.reconfigure(config.scheduler, config.cache)

    def reconfigure(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        """Swaps policy, limits or KV size without reloading weights (when idle)."""
        if getattr(self, "scheduler", None) is not None and self.has_unfinished_requests():
            raise RuntimeError("cannot reconfigure an engine with unfinished requests")
        self.config = dataclasses.replace(self.config, scheduler=scheduler_config,
                                          cache=cache_config)
        scheduler_config = scheduler_config.resolved(self.model_config.max_position_embeddings)
        self.max_model_len = scheduler_config.max_model_len
        block_size = cache_config.block_size
        num_blocks = self._num_kv_blocks()
        self.block_manager = BlockManager(num_blocks, block_size, cache_config.watermark)
        self.scheduler = make_scheduler(scheduler_config, self.block_manager)
        if isinstance(self.executor, DistributedExecutor):
            self.executor.reset_kv(num_blocks, block_size)
        else:
            self.executor = None  # drop the old KV cache before allocating the new one
            self.executor = LocalExecutor(ModelRunner(
                self.model, self.model_config, num_blocks, block_size, self.dtype, self.device,
                seed=self.config.seed))
        self._groups: dict[str, _Group] = {}
        self._child_to_group: dict[str, tuple[str, int]] = {}
        # Recent history only (each record holds its batch's shape): --iteration-log keeps all.
        self.iterations: deque[IterationRecord] = deque(maxlen=10_000)

    @property
    def runner(self) -> ModelRunner | None:
        """The in-process model runner; None when the weights live in worker processes."""
        return self.executor.runner if isinstance(self.executor, LocalExecutor) else None

    # ---- capacity -------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        """Blocks every rank can hold (the block table is shared): sized by the rank
        with the most KV per token; kv_cache_memory is per rank."""
        cache, parallel = self.config.cache, self.config.parallel
        shards = [Shard.of_rank(r, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
                  for r in range(parallel.world_size)]
        block_bytes = max(kv_cache_bytes_per_token(self.model_config, self.dtype, s)
                          for s in shards) * cache.block_size
        free = None
        if cache.kv_cache_memory is None and self.device.type == "cuda":
            if isinstance(self.executor, DistributedExecutor):
                free = min(w.free_memory for w in self.executor.workers)
            else:
                free, _ = torch.cuda.mem_get_info(self.device)
        budget = cache.kv_bytes(self.device.type, free)
        num_blocks = budget // block_bytes
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory={budget} bytes holds no KV block "
                             f"(one block of {cache.block_size} tokens takes {block_bytes} bytes)")
        return num_blocks

    # ---- requests -------------------------------------------------------------
    def tokenize(self, prompt: str) -> list[int]:
        return self.tokenizer(prompt)["input_ids"]

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None, arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        text = prompt if isinstance(prompt, str) else None
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        self._validate_prompt(token_ids)
        vocab = self.model_config.vocab_size
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        children = []
        for i in range(params.n):
            child_params = params
            if params.n > 1 and params.seed is not None:
                child_params = dataclasses.replace(params, seed=params.seed + i)
            child_id = request_id if params.n == 1 else f"{request_id}#{i}"
            children.append(Request(child_id, token_ids, child_params, arrival,
                                    eos_token_ids=self.eos_token_ids))
        group = _Group(text, token_ids, arrival, children,
                       [IncrementalDetokenizer(self.tokenizer, params.stop,
                                               params.include_stop_str_in_output)
                        for _ in children], [False] * params.n, [[] for _ in children])
        for i, child in enumerate(children):
            self.scheduler.add_request(child)
            self._child_to_group[child.request_id] = (request_id, i)
        self._groups[request_id] = group

    def _validate_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt has {len(token_ids)} tokens, but max_model_len is "
                             f"{self.max_model_len}: it must be shorter to leave room for output")

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            self.scheduler.abort_request(child.request_id)
            self._child_to_group.pop(child.request_id, None)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def shutdown(self) -> None:
        """Stops worker processes (a no-op in-process); the engine is unusable after."""
        if self.executor is not None:
            self.executor.shutdown()

    # ---- the loop -------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        """Runs one iteration; returns what each sequence that got a token gained.

        With pipeline parallelism, first fills the pipeline (up to one micro-batch
        per stage, none holding a request already in flight), then completes the
        oldest micro-batch in flight.
        """
        busy = frozenset(rid for f in self._in_flight for rid in f.record.request_ids)
        while len(self._in_flight) < self.executor.depth:
            start, cpu_start = time.monotonic(), time.thread_time()
            output = self.scheduler.schedule(start, busy)
            if output.is_empty:
                break
            record = IterationRecord.scheduled(output, start)
            self.executor.submit(output)
            self._in_flight.append(_Flight(output, record, cpu_start))
            busy |= frozenset(record.request_ids)
        if not self._in_flight:
            if self.scheduler.num_waiting and not self.scheduler.num_running:
                raise RuntimeError("scheduler admitted nothing although requests are waiting "
                                   "and none is running")
            return []
        flight = self._in_flight.popleft()
        output = flight.output
        result = self.executor.receive()
        end = time.monotonic()
        self.scheduler.update(output, result.sampled, end)
        self.iterations.append(dataclasses.replace(
            flight.record, end=end, cpu_time=time.thread_time() - flight.cpu_start,
            stage_times=tuple(result.stage_times)))
        # A chunk that ends mid-prompt produced nothing to report.
        return [self._emit(chunk.request, result.sampled[chunk.request_id],
                           result.logprobs.get(chunk.request_id))
                for chunk in output.chunks
                if chunk.request_id in result.sampled and chunk.request_id in self._child_to_group]

    def _emit(self, request: Request, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        parent_id, index = self._child_to_group[request.request_id]
        group = self._groups[parent_id]
        detokenizer = group.detokenizers[index]
        delta = ""
        if not group.stop_hit[index]:
            delta, hit = detokenizer.append(token)
            if hit:
                group.stop_hit[index] = True
                if not request.is_finished:
                    self.scheduler.finish_request(request.request_id,
                                                  RequestStatus.FINISHED_STOPPED)
        if request.is_finished:
            delta += detokenizer.flush()
        new_logprobs = None
        if logprobs is not None:
            group.logprobs[index].append(logprobs)
            new_logprobs = [logprobs]
        return StepOutput(parent_id, index, [token], delta, request.finish_reason, new_logprobs)

    def request_output(self, request_id: str) -> RequestOutput:
        group = self._groups[request_id]
        outputs = [CompletionOutput(i, detok.text, list(child.output_token_ids),
                                    child.finish_reason, list(child.token_times),
                                    child.num_preemptions,
                                    list(group.logprobs[i])
                                    if child.sampling_params.logprobs is not None else None)
                   for i, (child, detok) in enumerate(zip(group.children, group.detokenizers))]
        first = [c.first_scheduled_time for c in group.children if c.first_scheduled_time]
        return RequestOutput(request_id, group.prompt, group.prompt_token_ids, outputs,
                             group.arrival_time, min(first) if first else None)

    def is_finished(self, request_id: str) -> bool:
        return all(c.is_finished for c in self._groups[request_id].children)

    def release(self, request_id: str) -> RequestOutput:
        """Returns a finished request's output and forgets it."""
        out = self.request_output(request_id)
        for child in self._groups.pop(request_id).children:
            self._child_to_group.pop(child.request_id, None)
        return out
