"""LLMEngine: turns requests into tokens, one scheduler iteration per step()."""
from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import torch

from . import huge_pages
from .config import (
    CacheConfig,
    EngineConfig,
    SchedulerConfig,
    dtype_needs_cpu_probe,
    resolve_device,
    resolve_dtype,
    resolve_threads,
)
from .distributed.executors import make_executor
from .executor.cost_probe import calibrate
from .executor.hardware import available_cores, probe_cpu_bf16
from .model import kv_quant
from .model.decoder import kv_cache_bytes_per_token
from .model.parallel import Shard
from .model.tokenizer import eos_token_ids, load_tokenizer
from .outputs import (
    EngineInfo,
    EngineStats,
    IterationRecord,
    RequestOutput,
    StepOutput,
    StepResult,
    TokenLogprobs,
    iteration_period,
)
from .request import RequestStatus
from .request_group import RequestGroup
from .sampling_params import SamplingParams
from .scheduler import OnlineCost, make_scheduler
from .scheduler.cost_fit import BatchFeatures
from .scheduler.kv_cache import BlockManager
from .scheduler.output import SchedulerOutput
from .scheduler.pipeline import next_micro_batch
from .structured import GrammarCompileService, GrammarMatchers

# How long an engine with only grammars compiling waits for one (instead of spinning).
_COMPILE_WAIT = 0.005

logger = logging.getLogger("stallfree.engine")


@dataclass
class _Flight:
    """A submitted micro-batch whose result has not been applied yet."""

    output: SchedulerOutput
    record: IterationRecord
    cpu_start: float  # the engine thread's CPU clock when it was scheduled


def choose_dtype(name: str | None, device_type: str) -> tuple[str, str]:
    """The engine's dtype (a torch attribute name) and why: `auto` times this CPU's bf16."""
    probe = None
    if dtype_needs_cpu_probe(name, device_type):
        result = probe_cpu_bf16()
        probe = (result.fast, result.reason)
    return resolve_dtype(name, device_type, probe)


class LLMEngine:
    def __init__(self, config: EngineConfig | None = None,
                 cost_seed: OnlineCost | None = None) -> None:
        """`cost_seed`: with tbt_slo, the iteration cost model to start from (e.g. fitted
        to a `stallfree profile` result); None calibrates one at start-up."""
        self.config = config = config or EngineConfig()
        self.cost: OnlineCost | None = cost_seed
        # The last iteration's features, start and end, observed once the next one starts.
        self._unobserved: tuple[BatchFeatures, float, float] | None = None
        self.device = torch.device(resolve_device(config.device, torch.cuda.is_available()))
        threads = resolve_threads(config.threads, os.environ.get("OMP_NUM_THREADS"),
                                  available_cores())
        if self.device.type == "cpu" and config.parallel.world_size == 1:
            torch.set_num_threads(threads)  # before the probe, which times this many
        dtype_name, why = choose_dtype(config.dtype, self.device.type)
        logger.info("dtype %s (%s); %d compute threads", dtype_name, why, threads)
        self.dtype = getattr(torch, dtype_name)
        self.executor, self.model_config, self.kernels, weights = make_executor(
            config, self.device, dtype_name)
        for op, impl, reason in self.kernels.rows():
            logger.info("kernel %s: %s (%s)", op, impl, reason)
        logger.info("matmul weights: %s", weights)
        self.info = EngineInfo(self.device.type, dtype_name, why, threads, huge_pages.status(),
                               self.kernels.rows(), weights)
        self.tokenizer = load_tokenizer(config.model)
        self.eos_token_ids = eos_token_ids(self.tokenizer, self.model_config)
        # Thread-safe: the server submits a request's grammar before queueing it.
        self.grammars = GrammarCompileService(self.tokenizer, self.model_config.vocab_size,
                                              self.eos_token_ids)
        self._in_flight: deque[_Flight] = deque()
        self.scheduler = None
        self.reconfigure(config.scheduler, config.cache)
        if self.device.type == "cpu":
            mib = huge_pages.huge_page_mib()
            log = logger.warning if huge_pages.torch_was_first() else logger.info
            log("huge pages %s%s", self.info.huge_pages,
                "" if mib is None else f"; {mib:.0f} MiB of this process in them")

    def reconfigure(self, scheduler_config: SchedulerConfig, cache_config: CacheConfig) -> None:
        """Swaps policy, limits or KV size without reloading weights (when idle)."""
        if self.scheduler is not None and self.has_unfinished_requests():
            raise RuntimeError("cannot reconfigure an engine with unfinished requests")
        self.config = dataclasses.replace(self.config, scheduler=scheduler_config,
                                          cache=cache_config)
        limit = self.model_config.max_position_embeddings
        scheduler_config = scheduler_config.resolved(limit)
        self.max_model_len = scheduler_config.max_model_len
        self.kv_dtype = kv_quant.cache_dtype(cache_config.kv_cache_dtype, self.dtype)
        num_blocks = self._num_kv_blocks()
        kv_name = str(self.kv_dtype).removeprefix("torch.")
        self.info = dataclasses.replace(self.info, kv_cache_dtype=kv_name)
        logger.info("KV cache: %s, %d blocks of %d tokens (%d bytes per token)", kv_name,
                    num_blocks, cache_config.block_size,
                    kv_cache_bytes_per_token(self.model_config, self.kv_dtype))
        # Cached KV is valid only for this model in these dtypes: they name the cache's keys.
        namespace = f"{self.config.model}|{self.dtype}|{self.kv_dtype}".encode()
        self.block_manager = BlockManager(num_blocks, cache_config.block_size,
                                          cache_config.watermark,
                                          cache_config.enable_prefix_caching, namespace,
                                          self.model_config.kv_window)
        self.executor.reset_kv(num_blocks, cache_config.block_size, cache_config.kv_cache_dtype)
        if scheduler_config.tbt_slo is not None and self.cost is None:
            started = time.perf_counter()
            self.cost = calibrate(self.executor, num_blocks, cache_config.block_size,
                                  self.max_model_len, scheduler_config.token_budget)
            logger.info("tbt_slo: iteration cost calibrated in %.1f s: %s",
                        time.perf_counter() - started, self.cost.describe())
        self.scheduler = make_scheduler(scheduler_config, self.block_manager, self.cost,
                                        self.model_config.logits_row_cost)
        self._groups: dict[str, RequestGroup] = {}
        self._child_to_group: dict[str, tuple[str, int]] = {}
        self._matchers = GrammarMatchers(self.model_config.vocab_size)
        # Recent history only (each record holds its batch's shape): --iteration-log keeps all.
        self.iterations: deque[IterationRecord] = deque(maxlen=10_000)

    def stats(self) -> EngineStats:
        bm = self.block_manager
        cached = bm.prefix_cache_stats
        return EngineStats(self.scheduler.num_running,
                           self.scheduler.num_waiting + len(self.scheduler.unready), bm.usage,
                           bm.num_free_blocks, bm.num_total_blocks, cached.queries, cached.hits,
                           getattr(self.scheduler, "margin", None))

    def reset_prefix_cache(self) -> int:
        """Forgets every cached KV block (running requests keep theirs); returns how many
        blocks were cached."""
        return self.block_manager.reset_prefix_cache()

    # ---- capacity -------------------------------------------------------------
    def _num_kv_blocks(self) -> int:
        """Blocks every rank can hold (the block table is shared): sized by the rank
        with the most KV per token; kv_cache_memory is per rank."""
        cache, parallel = self.config.cache, self.config.parallel
        shards = [Shard.of_rank(r, parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
                  for r in range(parallel.world_size)]
        block_bytes = max(kv_cache_bytes_per_token(self.model_config, self.kv_dtype, s)
                          for s in shards) * cache.block_size
        free = self.executor.free_memory() if cache.kv_cache_memory is None else None
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
                    params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self._groups:
            raise ValueError(f"request_id {request_id!r} is already in use")
        token_ids = self.tokenize(prompt) if isinstance(prompt, str) else list(prompt)
        # The scheduler checks the prompt's length; only the engine knows the vocabulary.
        vocab = self.model_config.vocab_size
        if not all(isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab
                   for t in token_ids):
            raise ValueError(f"prompt token ids must be integers in [0, {vocab})")
        if any(t >= vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be below the vocabulary size {vocab}")
        # A bad or oversized constraint raises here; it compiles only once accepted.
        spec = params.structured_outputs
        if spec is not None:
            self.grammars.check(spec)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        group = RequestGroup(request_id, prompt if isinstance(prompt, str) else None, token_ids,
                             params, arrival, self.tokenizer, self.eos_token_ids)
        for child in group.children:
            child.ready = spec is None  # a constrained child waits (unready) for its grammar
        # All n sequences or none; with prefix caching they share one prefill of the prompt.
        self.scheduler.add_group(group.children)
        if spec is not None:
            for child in group.children:  # off this thread; cancelled if the child leaves first
                self._matchers.add(child, self.grammars.submit(spec))
        for i, child in enumerate(group.children):
            self._child_to_group[child.request_id] = (request_id, i)
        self._groups[request_id] = group

    def abort_request(self, request_id: str) -> None:
        group = self._groups.pop(request_id, None)
        if group is None:
            return
        for child in group.children:
            self.scheduler.abort_request(child.request_id)
            self._child_to_group.pop(child.request_id, None)
            self._matchers.remove(child.request_id)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests() or bool(self._in_flight)

    def shutdown(self) -> None:
        """Stops worker processes (a no-op in-process); the engine is unusable after."""
        self.executor.shutdown()
        self.grammars.shutdown()

    # ---- the loop -------------------------------------------------------------
    def step(self) -> StepResult:
        """Runs one iteration: what each sequence gained, the requests it finished (released
        here, so the caller owns their outputs) and the iteration's record.

        With pipeline parallelism, first fills the pipeline (up to one micro-batch
        per stage, none holding a request already in flight), then completes the
        oldest micro-batch in flight.
        """
        compile_failed = self._start_compiled()
        busy = {rid for f in self._in_flight for rid in f.record.request_ids}
        while len(self._in_flight) < self.executor.depth:
            start, cpu_start = time.monotonic(), time.thread_time()
            output = next_micro_batch(self.scheduler, start, busy, len(self._in_flight))
            if output is None:
                break
            self._observe_period(start)
            record = output.iteration_record(start)
            self._matchers.fill_bitmask(output)
            self.executor.submit(output)
            self._in_flight.append(_Flight(output, record, cpu_start))
            busy.update(record.request_ids)
        if not self._in_flight:
            self._matchers.wait(_COMPILE_WAIT)  # unless no grammar is compiling
            return StepResult([], compile_failed, None)
        flight = self._in_flight.popleft()
        output = flight.output
        result = self.executor.receive()
        end = time.monotonic()
        failed: dict[str, str] = {}
        for child_id, reason in result.failed.items():  # before update: they have no token
            self._fail(child_id, reason, failed)
        for child_id, scored in result.prompt_logprobs.items():
            if child_id in self._child_to_group:  # else aborted meanwhile
                self._groups[self._child_to_group[child_id][0]].add_prompt_logprobs(scored)
        self.scheduler.update(output, result.sampled, end)
        record = dataclasses.replace(flight.record, end=end,
                                     cpu_time=time.thread_time() - flight.cpu_start,
                                     stage_times=tuple(result.stage_times))
        self.iterations.append(record)
        if self.cost is not None and self.executor.depth == 1:
            # The SLO's model follows this machine: every completed iteration refines it
            # (under PP, end - start would include the wait behind other micro-batches).
            self._unobserved = (BatchFeatures.of_shape(record.prefill_chunks,
                                                       record.decode_contexts),
                                record.start, end)
        outputs = []
        for c in output.chunks:
            # A chunk that ends mid-prompt produced nothing to report.
            if c.request_id not in result.sampled or c.request_id not in self._child_to_group:
                continue
            try:
                outputs.append(self._emit(c.request_id, result.sampled[c.request_id],
                                          result.logprobs.get(c.request_id)))
            except Exception as exc:  # noqa: BLE001 - e.g. its detokenizing: it fails alone
                self._fail(c.request_id, f"{type(exc).__name__}: {exc}", failed)
        finished = compile_failed
        for out in outputs:  # with n > 1, the last sequence to finish ends the request
            group = self._groups.get(out.request_id)
            if out.finish_reason and group is not None and group.is_finished:
                finished.append(self._release(out.request_id))
        if self._unobserved is not None and not self.has_unfinished_requests():
            self._observe_period(None)  # no next iteration: its own time is all there is
        return StepResult(outputs, finished, record, failed)

    def _observe_period(self, next_start: float | None) -> None:
        """Refines the SLO's model with the last iteration's period up to `next_start`
        (`iteration_period`): a decode waits that long between two tokens, its output's
        handling (detokenizing, streaming, a client on the same core) included."""
        if self._unobserved is None or self.cost is None:
            return
        features, start, end = self._unobserved
        self._unobserved = None
        self.cost.observe(features, iteration_period(start, end, next_start))

    def _fail(self, child_id: str, reason: str, failed: dict[str, str]) -> None:
        """Ends the request owning sequence `child_id` (all its sequences) after an error of
        its own; `failed` gets its id and the reason."""
        if child_id not in self._child_to_group:
            return  # already ended (aborted meanwhile, or a sibling failed first)
        request_id = self._child_to_group[child_id][0]
        logger.warning("request %s failed and was ended: %s", request_id, reason)
        self.abort_request(request_id)
        failed[request_id] = reason

    def check_workers(self) -> None:
        """Raises WorkerError if a worker process died or went silent (a no-op in-process)."""
        check = getattr(self.executor, "check", None)
        if check is not None:
            check()

    def restart_executor(self) -> list[str]:
        """After the executor's workers failed: starts them afresh with the same KV cache
        size and requeues every running request for recompute (the preemption path), so
        its client sees a delay, not an error; returns the ids requeued. Greedy and
        seeded sequences continue with the tokens they would have had. Raises if the
        executor cannot restart (an in-process model, or workers on other machines)."""
        self._in_flight.clear()  # lost with the workers; none was applied
        self.executor.restart()
        bm = self.block_manager
        self.executor.reset_kv(bm.num_total_blocks, bm.block_size,
                               self.config.cache.kv_cache_dtype)
        requeued = self.scheduler.preempt_all()
        # Preempted blocks stay cached for their recompute, but their KV died with the
        # workers: a hit now would read zeros.
        bm.reset_prefix_cache()
        logger.warning("workers restarted; %d running sequences requeued for recompute",
                       len(requeued))
        return requeued

    def abort_all(self) -> list[str]:
        """Ends every request and discards the batches in flight (after a failed step whose
        cause no single request owns); returns the ids ended. The engine stays usable."""
        ids = list(self._groups)
        for request_id in ids:
            self.abort_request(request_id)
        while self._in_flight:  # their results belong to requests just ended
            self._in_flight.popleft()
            self.executor.receive()
        return ids

    def _emit(self, child_id: str, token: int, logprobs: TokenLogprobs | None) -> StepOutput:
        parent_id, index = self._child_to_group[child_id]
        group = self._groups[parent_id]
        if group.children[index].sampling_params.max_tokens == 0:  # the prompt only
            return group.step_output(index, None, "", None)
        delta, stop_hit = group.append(index, token, logprobs)
        grammar_ended = self._matchers.advance(child_id)
        if (stop_hit or grammar_ended) and not group.children[index].is_finished:
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_STOPPED)
        return group.step_output(index, token, delta, logprobs)

    def _start_compiled(self) -> list[RequestOutput]:
        """Requests whose grammar has compiled become schedulable; one whose compile
        failed ends (aborted), and its finished request is returned."""
        finished = []
        for child_id in self._matchers.poll():
            self.scheduler.finish_request(child_id, RequestStatus.FINISHED_ABORTED)
            group = self._groups[self._child_to_group[child_id][0]]
            if group.is_finished:
                finished.append(self._release(group.request_id))
        return finished

    def request_output(self, request_id: str) -> RequestOutput:
        """The request's output so far (it stays in the engine)."""
        return self._groups[request_id].output()

    def _release(self, request_id: str) -> RequestOutput:
        group = self._groups.pop(request_id)
        for child in group.children:
            self._child_to_group.pop(child.request_id, None)
            self._matchers.remove(child.request_id)
        return group.output()
