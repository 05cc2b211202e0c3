"""Filling a pipeline of micro-batches: the rule the engine and the simulator share."""
from __future__ import annotations

from collections.abc import Collection

from .base import Scheduler
from .output import SchedulerOutput


def next_micro_batch(scheduler: Scheduler, now: float, in_flight: Collection[str],
                     num_in_flight: int) -> SchedulerOutput | None:
    """The next micro-batch to start beside `num_in_flight` others, or None if none is ready.

    `in_flight` names the requests of those micro-batches: a request is never scheduled
    twice at once. Raises RuntimeError when requests wait, none runs and none is in flight,
    yet the policy admits nothing: it never would, and the caller would spin forever.
    """
    if not scheduler.has_unfinished_requests():
        return None
    output = scheduler.schedule(now, frozenset(in_flight))
    if not output.is_empty:
        return output
    if not num_in_flight and scheduler.num_waiting and not scheduler.num_running:
        raise RuntimeError("scheduler admitted nothing although requests are waiting "
                           "and none is running")
    return None
