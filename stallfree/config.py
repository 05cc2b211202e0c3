"""Engine configuration as plain dataclasses."""
from __future__ import annotations

from dataclasses import dataclass, field

# Scheduling policies (stallfree/scheduler/): Sarathi-Serve, its baselines and an
# ablation. The other ablation, hybrid batching only, is sarathi with
# token_budget = max_model_len.
POLICIES = ("sarathi", "vllm", "orca", "request_level", "chunked_only")


@dataclass
class SchedulerConfig:
    policy: str = "sarathi"
    token_budget: int = 512  # max tokens computed per iteration (max_num_batched_tokens)
    max_num_seqs: int = 128  # max requests running at once
    max_model_len: int = 8192  # prompt + output limit per request

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        for name in ("token_budget", "max_num_seqs", "max_model_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")


@dataclass
class CacheConfig:
    block_size: int = 16
    # KV cache size in bytes; None means a default share of the device's memory.
    kv_cache_memory: int | None = None
    # Fraction of blocks kept free when admitting new requests, so running ones can grow.
    watermark: float = 0.01

    def __post_init__(self) -> None:
        if not isinstance(self.block_size, int) or self.block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {self.block_size!r}")
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Workers this process starts (ranks 0 .. n-1); None = all of them. The other
    # ranks join from other machines with `stallfree worker` (see docs/parallelism.md).
    num_local_workers: int | None = None
    startup_timeout: float = 600.0  # seconds for every worker to load its shard

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        local = self.num_local_workers
        if local is not None and not 0 <= local <= self.world_size:
            raise ValueError(f"num_local_workers must be in [0, {self.world_size}], got {local!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: str | None = None  # GGUF file or Hugging Face directory; None = default model
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    device: str | None = None  # None: cuda if available else cpu
    seed: int = 0
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
