"""The scheduler: pure Python, never imports torch (the simulator reuses it as is)."""
from __future__ import annotations

from ..config import SchedulerConfig
from .base import Scheduler
from .chunked_only import ChunkedOnlyScheduler
from .cost_fit import OnlineCost
from .kv_cache import BlockManager
from .orca import OrcaScheduler
from .output import ScheduledChunk, SchedulerOutput
from .request_level import RequestLevelScheduler
from .sarathi import SarathiScheduler
from .slo_sarathi import SloSarathiScheduler
from .vllm import VLLMScheduler

# One entry per policy in config.POLICIES.
_POLICIES: dict[str, type[Scheduler]] = {
    "sarathi": SarathiScheduler,
    "vllm": VLLMScheduler,
    "orca": OrcaScheduler,
    "request_level": RequestLevelScheduler,
    "chunked_only": ChunkedOnlyScheduler,
}


def make_scheduler(config: SchedulerConfig, block_manager: BlockManager,
                   cost: OnlineCost | None = None,
                   prompt_logprob_cost: float = 1.0) -> Scheduler:
    """Builds the scheduler of the policy named by `config.policy`; with `config.tbt_slo`,
    sarathi's budget comes from the SLO and `cost`, the iteration time's prediction.
    `prompt_logprob_cost`: a prompt position with logprobs, in budget tokens (>= 1)."""
    if prompt_logprob_cost < 1.0:
        raise ValueError(f"prompt_logprob_cost must be >= 1, got {prompt_logprob_cost!r}")
    if config.tbt_slo is not None:
        if cost is None:
            raise ValueError("tbt_slo needs a cost model to predict iteration times")
        scheduler: Scheduler = SloSarathiScheduler(config, block_manager, cost)
    else:
        try:
            cls = _POLICIES[config.policy]
        except KeyError:
            raise ValueError(f"unknown scheduling policy {config.policy!r}; "
                             f"known: {', '.join(sorted(_POLICIES))}") from None
        scheduler = cls(config, block_manager)
    scheduler.prompt_logprob_cost = prompt_logprob_cost
    return scheduler


__all__ = ["BlockManager", "ChunkedOnlyScheduler", "OnlineCost", "OrcaScheduler",
           "RequestLevelScheduler", "SarathiScheduler", "ScheduledChunk", "Scheduler",
           "SchedulerOutput", "SloSarathiScheduler", "VLLMScheduler", "make_scheduler"]
