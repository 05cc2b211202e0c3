"""Discrete-event simulation: the engine's own scheduler on a virtual clock with predicted times.

The loop is the engine's (`LLMEngine.step`): requests that have arrived are
added, `schedule(now)` picks the batch, the clock advances by the cost
model's time for that batch, `update(output, sampled, now)` applies it. The
scheduler classes are used unchanged; the fake executor samples token 0 for
every completed chunk (requests use ignore_eos and max_tokens = the trace's
output length, as the benchmark client sends them), so requests end by length.

Pipeline parallelism (PP stages): up to PP micro-batches are in flight; a new
one is scheduled whenever stage 0 is free. A micro-batch runs the CPU part
then each stage in turn (waiting for the stage to be free, plus the send
between stages), and is applied to the scheduler when it leaves the last
stage. Requests in flight are passed to `schedule` as `busy`, exactly as the
engine does under PP: they are neither scheduled again nor preempted until
their micro-batch returns, and they keep their KV blocks and still count
against max_num_seqs. Uneven micro-batches leave stages idle: bubbles.

The block manager is the engine's, prefix cache included (`enable_prefix_caching`):
repeated prefixes (a shared system prompt, the turns of a conversation) hit as they
would in the engine, and the cached tokens cost no budget. A later turn of a
conversation arrives its think time after the previous turn's last token.
"""
from __future__ import annotations

import heapq
import itertools
from dataclasses import dataclass, field

from ..bench.records import RequestResult, RunResult
from ..bench.workload import RequestSpec
from ..config import SchedulerConfig
from ..request import Request
from ..sampling_params import SamplingParams
from ..scheduler import BlockManager, Scheduler, make_scheduler
from ..scheduler.output import SchedulerOutput
from ..scheduler.pipeline import next_micro_batch
from .cost_model import BatchShape, CostModel
from .slo_fit import fit_cost_model

FAKE_TOKEN = 0  # never an EOS: requests carry ignore_eos and no stop tokens


@dataclass
class SimConfig:
    scheduler: SchedulerConfig
    num_blocks: int
    block_size: int = 16
    watermark: float = 0.01
    max_duration: float | None = None  # virtual seconds; later requests fail like the client's
    keep_outputs: bool = False  # keep every SchedulerOutput (tests compare decisions)
    enable_prefix_caching: bool = True


@dataclass
class Iteration:
    """One micro-batch: when it was scheduled, when each stage ran, what it held."""

    scheduled: float
    stages: list[tuple[float, float]]  # (start, end) on each pipeline stage
    num_prefill_tokens: int
    num_decode_tokens: int
    num_seqs: int
    num_preempted: int
    cpu: float

    @property
    def end(self) -> float:
        return self.stages[-1][1]


@dataclass(order=True)
class _InFlight:
    end: float
    seq: int
    output: SchedulerOutput = field(compare=False)


@dataclass
class SimResult:
    run: RunResult
    requests: list[Request | None]  # by workload index; None if the scheduler refused it
    iterations: list[Iteration]
    num_blocks: int
    pp: int
    outputs: list[SchedulerOutput] = field(default_factory=list)  # with keep_outputs

    def stage_busy_fraction(self) -> float:
        """Share of stage time spent computing between the first and last micro-batch."""
        if not self.iterations:
            return 0.0
        start = min(it.stages[0][0] for it in self.iterations)
        span = max(it.end for it in self.iterations) - start
        busy = sum(e - s for it in self.iterations for s, e in it.stages)
        return busy / (span * self.pp) if span > 0 else 0.0

    def bubble_fraction(self) -> float:
        """Idle share of the stages while any micro-batch is in flight (idle queues excluded)."""
        spans = sorted((it.scheduled, it.end) for it in self.iterations)
        covered, cur_start, cur_end = 0.0, None, None
        for s, e in spans:
            if cur_end is None or s > cur_end:
                if cur_end is not None:
                    covered += cur_end - cur_start
                cur_start, cur_end = s, e
            else:
                cur_end = max(cur_end, e)
        if cur_end is not None:
            covered += cur_end - cur_start
        busy = sum(e - s for it in self.iterations for s, e in it.stages)
        return 1.0 - busy / (covered * self.pp) if covered > 0 else 0.0

    def summary(self) -> dict[str, float | int]:
        its = self.iterations
        n = len(its)
        return {
            "iterations": n, "num_kv_blocks": self.num_blocks, "pipeline_stages": self.pp,
            "mean_iteration_s": sum(it.end - it.scheduled for it in its) / n if n else 0.0,
            "mean_batched_tokens": sum(it.num_prefill_tokens + it.num_decode_tokens
                                       for it in its) / n if n else 0.0,
            "mean_batch_seqs": sum(it.num_seqs for it in its) / n if n else 0.0,
            "num_preemptions": sum(it.num_preempted for it in its),
            "stage_busy_fraction": self.stage_busy_fraction(),
            "pipeline_bubble_fraction": self.bubble_fraction(),
        }


def make_request(spec: RequestSpec, arrival: float | None = None) -> Request:
    """The request the server would build from the client's body (max_tokens, ignore_eos),
    arriving at `arrival` (default: the spec's)."""
    params = SamplingParams(max_tokens=spec.output_len, ignore_eos=True, temperature=0.0)
    return Request(str(spec.index), spec.prompt_token_ids, params,
                   spec.arrival if arrival is None else arrival)


class Simulator:
    def __init__(self, config: SimConfig, cost: CostModel) -> None:
        self.config = config
        self.cost = cost
        self.pp = cost.pp
        self.block_manager = BlockManager(config.num_blocks, config.block_size, config.watermark,
                                          config.enable_prefix_caching)
        sched = config.scheduler
        # Under a TBT SLO the scheduler predicts with the scheduler's linear model fitted to
        # this cost model (no online refit: the simulated times are the cost model's).
        slo_cost = None if sched.tbt_slo is None else fit_cost_model(
            cost, sched.token_budget, sched.max_model_len)
        self.scheduler: Scheduler = make_scheduler(sched, self.block_manager, slo_cost)
        self.now = 0.0
        self.iterations: list[Iteration] = []
        self.outputs: list[SchedulerOutput] = []
        self._stage_free = [0.0] * self.pp
        self._inflight: list[_InFlight] = []  # heap by completion time
        self._where: dict[str, _InFlight] = {}  # request id -> its micro-batch in flight
        self._seq = itertools.count()
        self._arrivals: list[tuple[float, int, RequestSpec]] = []  # heap: (due, index, spec)
        self._next_turn: dict[int, RequestSpec] = {}
        self._errors: dict[int, str] = {}

    def _launch(self, out: SchedulerOutput) -> None:
        cost = self.cost.iteration(BatchShape.from_output(out))
        t = self.now + cost.cpu
        stages = []
        for s in range(self.pp):
            start = max(t + (cost.send if s else 0.0), self._stage_free[s])
            t = start + cost.stage
            self._stage_free[s] = t
            stages.append((start, t))
        if self.config.keep_outputs:
            self.outputs.append(out)
        job = _InFlight(t, next(self._seq), out)
        heapq.heappush(self._inflight, job)
        for chunk in out.chunks:
            self._where[chunk.request_id] = job
        self.iterations.append(Iteration(self.now, stages, out.num_prefill_tokens,
                                         out.num_decode_tokens, out.num_seqs,
                                         len(out.preempted), cost.cpu))

    def _complete(self, job: _InFlight) -> None:
        self.now = max(self.now, job.end)
        for c in job.output.chunks:
            del self._where[c.request_id]
        sampled = {c.request_id: FAKE_TOKEN for c in job.output.chunks if c.samples}
        for request in self.scheduler.update(job.output, sampled, job.end):
            nxt = self._next_turn.get(int(request.request_id))
            if nxt is not None:  # the conversation's next turn, after its think time
                heapq.heappush(self._arrivals, (job.end + nxt.think_time, nxt.index, nxt))

    def _fail_rest(self, spec: RequestSpec, reason: str) -> None:
        """The later turns of a conversation whose turn `spec` was not served."""
        nxt = self._next_turn.get(spec.index)
        while nxt is not None:
            self._errors[nxt.index] = reason
            nxt = self._next_turn.get(nxt.index)

    # ---- the loop ------------------------------------------------------------------------
    def run(self, specs: list[RequestSpec]) -> SimResult:
        self._next_turn = {s.follows: s for s in specs if s.follows is not None}
        self._arrivals = [(s.arrival, s.index, s) for s in specs if s.follows is None]
        heapq.heapify(self._arrivals)
        requests: dict[int, Request | None] = {}
        sent: dict[int, float] = {}  # when each request reached the server
        errors = self._errors
        deadline = self.config.max_duration
        while True:
            # Arrivals up to now join the queue (the server adds them between steps).
            while self._arrivals and self._arrivals[0][0] <= self.now:
                due, _, spec = heapq.heappop(self._arrivals)
                if deadline is not None and due >= deadline:
                    self._fail_rest(spec, "not sent before the time limit")
                    continue
                req = make_request(spec, due)
                sent[spec.index] = due
                try:
                    self.scheduler.add_request(req)
                    requests[spec.index] = req
                except ValueError as err:  # the server answers 400 to such a request
                    requests[spec.index] = None
                    errors[spec.index] = f"HTTP 400: {err}"
                    self._fail_rest(spec, "previous turn failed")
            if len(self._inflight) < self.pp and self._stage_free[0] <= self.now:
                out = next_micro_batch(self.scheduler, self.now, self._where,
                                       len(self._inflight))
                if out is not None:
                    self._launch(out)
            # Advance to the next event: a completion, an arrival, or stage 0 freeing up.
            events = []
            if self._inflight:
                events.append(self._inflight[0].end)
                if len(self._inflight) < self.pp and self._stage_free[0] > self.now:
                    events.append(self._stage_free[0])
            if self._arrivals:
                events.append(self._arrivals[0][0])
            if not events:
                break
            nxt = min(events)
            if deadline is not None and nxt > deadline:
                break
            self.now = max(self.now, nxt)
            while self._inflight and self._inflight[0].end <= self.now:
                self._complete(heapq.heappop(self._inflight))
        return SimResult(_run_result(specs, requests, sent, errors, deadline),
                         [requests.get(s.index) for s in sorted(specs, key=lambda s: s.index)],
                         self.iterations, self.config.num_blocks, self.pp, self.outputs)


def _run_result(specs: list[RequestSpec], requests: dict[int, Request | None],
                sent: dict[int, float], errors: dict[int, str],
                deadline: float | None) -> RunResult:
    """The records the benchmark client would have made, for `bench.report.compute_report`."""
    results = []
    for spec in sorted(specs, key=lambda s: s.index):
        r = RequestResult(spec.index, spec.prompt_len, spec.output_len, spec.arrival,
                          turn=spec.turn)
        req = requests.get(spec.index)
        if spec.index not in requests:
            r.error = errors.get(spec.index, "not sent before the time limit")
        elif req is None:
            r.scheduled_time = r.send_time = sent[spec.index]
            r.error = errors[spec.index]
        else:
            r.scheduled_time = r.send_time = sent[spec.index]
            r.usage_cached_tokens = req.num_cached_tokens
            r.chunk_times = list(req.token_times)
            r.chunk_tokens = [1] * len(req.token_times)
            r.output_len = len(req.token_times)
            r.usage_prompt_tokens = spec.prompt_len
            if req.first_scheduled_time is not None:
                r.scheduling_delay = req.first_scheduled_time - req.arrival_time
            r.success = req.is_finished and r.output_len > 0
            if not r.success:
                r.error = "cancelled at the time limit"
        results.append(r)
    ends = [r.chunk_times[-1] for r in results if r.chunk_times]
    sends = [r.send_time for r in results if r.send_time is not None]
    duration = (max(ends) - min(sends)) if ends and sends else (deadline or 0.0)
    return RunResult(results, duration, start_unix=0.0)


def simulate(specs: list[RequestSpec], config: SimConfig, cost: CostModel) -> SimResult:
    return Simulator(config, cost).run(specs)
