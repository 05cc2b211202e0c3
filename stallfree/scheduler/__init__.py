"""The scheduler: pure Python, never imports torch (the simulator reuses it as is)."""
from __future__ import annotations

from ..config import SchedulerConfig
from .base import Scheduler
from .kv_cache import BlockManager
from .output import ScheduledChunk, SchedulerOutput
from .sarathi import SarathiScheduler

# One entry per policy in config.POLICIES.
_POLICIES: dict[str, type[Scheduler]] = {
    "sarathi": SarathiScheduler,
}


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    """Builds the scheduler of the policy named by `config.policy`."""
    try:
        cls = _POLICIES[config.policy]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {config.policy!r}; "
                         f"known: {', '.join(sorted(_POLICIES))}") from None
    return cls(config, block_manager)


__all__ = ["BlockManager", "SarathiScheduler", "ScheduledChunk", "Scheduler",
           "SchedulerOutput", "make_scheduler"]
