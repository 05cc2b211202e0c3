"""Sarathi-Serve with the token budget chosen every iteration from a TBT SLO.

The paper fixes the budget per deployment by offline profiling. Here the user states
the time between tokens they promise (`tbt_slo`), and every iteration does the most
work predicted to fit within `tbt_slo x margin`:

- every running decode is kept, as in plain sarathi (stall-free: a decode is never
  dropped to make room, even when the decodes alone overrun the target);
- each prefill chunk gets the largest token count whose predicted iteration time
  still fits, with `token_budget` (--max-num-batched-tokens) as an upper cap, lowered
  to the cost model's efficient chunk: past that size a token costs more (measured),
  so a larger iteration would do the same work in more time;
- a waiting request is admitted only if the decode batch it joins (every running
  request plus it, each at its current length) is predicted to fit, so admission
  does not build a decode batch the SLO cannot carry. With nothing running a
  request is admitted whatever its length, so none waits forever.

A request may carry its own `tbt_slo` (SamplingParams, or the extra field of both
OpenAI endpoints): each iteration keeps to the tightest target among the requests that
decode in it, and a request is admitted only if the batch it joins fits its own target
too. One that no iteration could meet is refused when it arrives.

The prediction is `cost_fit.OnlineCost`, which the engine refines from each measured
iteration (the simulator predicts with a fit of its cost model). The margin is
`tbt_slo_margin` where set; by default it is learned from the same iterations: a token
waits one iteration, so an iteration may fill the SLO divided by the 99th percentile of
how far measured times overran their prediction (on a shared core the tail is what
breaks a tight SLO, not the mean the fit follows).
"""
from __future__ import annotations

import dataclasses

from ..config import SchedulerConfig
from ..request import Request
from .batch import Batch
from .cost_fit import BatchFeatures, OnlineCost
from .kv_cache import BlockManager
from .output import SchedulerOutput
from .prefix_cache import PrefixHit
from .sarathi import SarathiScheduler

# The learned margin: the overrun's quantile it covers, its bounds, and its value until
# the cost model has seen enough iterations (OnlineCost.overrun).
OVERRUN_QUANTILE = 0.99
MARGIN_BOUNDS = (0.5, 0.95)
FIRST_MARGIN = 0.8


def largest_fit(cost: OnlineCost, base: BatchFeatures, start: int, cap: int,
                target: float) -> int:
    """The most tokens (0..cap) a chunk at position `start` can add to a batch of features
    `base` with the predicted time within `target`.

    A one-token chunk costs as a decode, several as a prefill chunk (a decode can cost
    more than a short chunk: the answer is only for a chunk of exactly that size, so
    cap must be what the chunk would take). Beyond one token the predicted time grows
    with the count (non-negative coefficients), so a binary search finds the largest
    that fits.
    """
    if cap < 1:
        return 0
    best = 1 if cost.predict(base.with_chunk(start, 1)) <= target else 0
    lo, hi = 2, cap  # invariant: every count below lo that is >= 2 fits
    while lo <= hi:
        mid = (lo + hi) // 2
        if cost.predict(base.with_chunk(start, mid)) <= target:
            best, lo = mid, mid + 1
        else:
            hi = mid - 1
    return best


class SloSarathiScheduler(SarathiScheduler):
    """`SarathiScheduler` whose budget is what the predicted time within the SLO allows."""

    def __init__(self, config: SchedulerConfig, block_manager: BlockManager,
                 cost: OnlineCost) -> None:
        if cost.efficient_tokens:
            config = dataclasses.replace(
                config, token_budget=min(config.token_budget, cost.efficient_tokens))
        super().__init__(config, block_manager)
        assert config.tbt_slo is not None
        self.cost = cost
        self._margin = self.margin  # this iteration's (schedule)
        self._iteration_target = self.target
        # An SLO no iteration can meet would stall every request: refuse it up front.
        self._check_slo(config.tbt_slo)

    @property
    def margin(self) -> float:
        """The share of an SLO an iteration's predicted time may fill, now."""
        if self.config.tbt_slo_margin is not None:
            return self.config.tbt_slo_margin
        overrun = self.cost.overrun(OVERRUN_QUANTILE)
        if overrun is None:
            return FIRST_MARGIN
        low, high = MARGIN_BOUNDS
        return min(high, max(low, 1.0 / overrun))

    @property
    def target(self) -> float:
        """The engine's own SLO times this iteration's margin."""
        return self.config.tbt_slo * self._margin

    def _check_slo(self, tbt_slo: float | None) -> None:
        if tbt_slo is None:
            return
        one_token = self.cost.predict(BatchFeatures().with_chunk(0, 1))
        # A learned margin moves: an SLO is reachable only if it stays so at its lowest,
        # else a request accepted now could later hold every iteration to itself alone.
        margin = self.config.tbt_slo_margin or MARGIN_BOUNDS[0]
        if one_token > tbt_slo * margin:
            raise ValueError(
                f"tbt_slo={tbt_slo} s is unreachable: an iteration of one token is "
                f"predicted to take {one_token:.4g} s, more than tbt_slo x the lowest margin "
                f"({margin:g}) = {tbt_slo * margin:.4g} s")

    def _target_of(self, request: Request) -> float:
        own = request.sampling_params.tbt_slo
        return self.target if own is None else min(self.target, own * self._margin)

    def schedule(self, now: float, busy: frozenset[str] = frozenset()) -> SchedulerOutput:
        self._margin = self.margin
        # The tightest SLO among the requests that decode in this iteration.
        self._iteration_target = min((self._target_of(r) for r in self.running
                                      if not r.is_prefill), default=self.target)
        out = super().schedule(now, busy)
        decodes = BatchFeatures.of_chunks((c.start, c.num_tokens) for c in out.chunks
                                          if not c.is_prefill)
        # The budget this iteration had: its decodes plus the most tokens of a fresh
        # (uncached) chunk that fit; chunks after a cached prefix get somewhat fewer.
        out.token_budget = decodes.decodes + largest_fit(
            self.cost, decodes, 0, self.config.token_budget - decodes.decodes,
            self._iteration_target)
        out.predicted_time = self.cost.predict(
            BatchFeatures.of_chunks((c.start, c.num_tokens) for c in out.chunks))
        out.target_time = self._iteration_target
        return out

    def _chunk_size(self, batch: Batch, start: int, wanted: int) -> int:
        base = BatchFeatures.of_chunks((c.start, c.num_tokens) for c in batch.chunks.values())
        fit = largest_fit(self.cost, base, start, min(wanted, batch.budget_left),
                          self._iteration_target)
        # An iteration must compute something: alone, a chunk gets a token even if the
        # model (drifted since the start-up check) predicts that one token overruns.
        return max(fit, 1) if not batch.chunks and batch.budget_left else fit

    def _can_admit(self, request: Request, num_tokens: int, hit: PrefixHit) -> bool:
        if not super()._can_admit(request, num_tokens, hit):
            return False
        if not self.running:
            return True
        joined = BatchFeatures(decodes=len(self.running) + 1,
                               decode_context=sum(r.num_tokens for r in self.running)
                               + request.num_tokens)
        # The batch it joins keeps to its own SLO too, from its first decode on.
        return self.cost.predict(joined) <= min(self._iteration_target,
                                                self._target_of(request))
