"""The whole model in this process: each batch runs when it is submitted."""
from __future__ import annotations

from collections import deque
from collections.abc import Mapping

import torch

from ..model import kv_quant
from ..model.config import ModelConfig
from ..model.decoder import CausalLM
from ..model.kernel_table import KernelTable
from ..scheduler.output import SchedulerOutput
from .base import RunnerOutput
from .model_runner import ModelRunner


class LocalExecutor:
    depth = 1
    restartable = False  # the model is this process: nothing to restart

    def __init__(self, model: CausalLM, model_config: ModelConfig, dtype: torch.dtype,
                 device: torch.device, seed: int = 0) -> None:
        self.model = model
        self.model_config = model_config
        self.dtype = dtype
        self.device = device
        self.seed = seed
        self.runner: ModelRunner | None = None  # made with the KV cache, by reset_kv
        self._done: deque[RunnerOutput] = deque()

    def free_memory(self) -> int | None:
        """Accelerator memory a new KV cache may take: what the device has free, what
        torch's allocator holds unused, and the current cache, which reset_kv drops first
        (else each reconfigure would size the cache by what the last one left)."""
        if self.device.type != "cuda":
            return None
        held = torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
        current = self.runner.kv_cache if self.runner is not None else None
        cache = current.numel() * current.element_size() if current is not None else 0
        return torch.cuda.mem_get_info(self.device)[0] + held + cache

    def reset_kv(self, num_blocks: int, block_size: int, kv_cache_dtype: str = "auto") -> None:
        """`kv_cache_dtype`: the setting's name (auto: the model's dtype; int8)."""
        self.runner = None  # drop the old KV cache before allocating the new one
        self.runner = ModelRunner(self.model, self.model_config, num_blocks, block_size,
                                  kv_quant.cache_dtype(kv_cache_dtype, self.dtype), self.device,
                                  seed=self.seed)

    @property
    def kernels(self) -> KernelTable:
        return self.model.kernels

    def use_kernels(self, overrides: Mapping[str, str] | None) -> KernelTable:
        """The model's table chosen again with these overrides (its weights repacked for it):
        one loaded model on several paths, for side-by-side comparisons."""
        self.model.prepack(overrides)
        if self.runner is not None:
            self.runner.sampler.kernels = self.model.kernels
        return self.model.kernels

    def submit(self, output: SchedulerOutput) -> None:
        self._done.append(self.runner.execute(output))

    def receive(self) -> RunnerOutput:
        return self._done.popleft()

    def restart(self) -> None:
        raise RuntimeError("an in-process executor has no workers to restart")

    def shutdown(self) -> None:
        self._done.clear()
