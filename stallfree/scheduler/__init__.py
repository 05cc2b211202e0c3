"""The scheduler: pure Python, never imports torch (the simulator reuses it as is)."""
from __future__ import annotations

from ..config import SchedulerConfig
from .base import Scheduler
from .chunked_only import ChunkedOnlyScheduler
from .kv_cache import BlockManager
from .orca import OrcaScheduler
from .output import ScheduledChunk, SchedulerOutput
from .request_level import RequestLevelScheduler
from .sarathi import SarathiScheduler
from .vllm import VLLMScheduler

# One entry per policy in config.POLICIES.
_POLICIES: dict[str, type[Scheduler]] = {
    "sarathi": SarathiScheduler,
    "vllm": VLLMScheduler,
    "orca": OrcaScheduler,
    "request_level": RequestLevelScheduler,
    "chunked_only": ChunkedOnlyScheduler,
}


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager) -> Scheduler:
    """Builds the scheduler of the policy named by `config.policy`."""
    try:
        cls = _POLICIES[config.policy]
    except KeyError:
        raise ValueError(f"unknown scheduling policy {config.policy!r}; "
                         f"known: {', '.join(sorted(_POLICIES))}") from None
    return cls(config, block_manager)


__all__ = ["BlockManager", "ChunkedOnlyScheduler", "OrcaScheduler", "RequestLevelScheduler",
           "SarathiScheduler", "ScheduledChunk", "Scheduler", "SchedulerOutput", "VLLMScheduler",
           "make_scheduler"]
