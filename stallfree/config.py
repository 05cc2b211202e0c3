"""Engine configuration: every default, its help text, and how `auto` values resolve.

A default is written once, here. The command line builds its flags from these
fields (`stallfree/cli/`), and `LLM(**engine_args)` fills them by name
(`EngineConfig.from_kwargs`). Pure Python: the scheduler and the simulator use it
too, so the resolvers take the facts they need (is there CUDA?) as arguments.
"""
from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from dataclasses import MISSING, dataclass, field
from typing import Any

from .kernel_ops import KERNEL_OPS, check_kernels, parse_kernels

# Scheduling policies (stallfree/scheduler/): Sarathi-Serve, its baselines and an
# ablation. The other ablation, hybrid batching only, is sarathi with
# token_budget = max_model_len.
POLICIES = ("sarathi", "vllm", "orca", "request_level", "chunked_only")
DTYPES = ("float32", "float16", "bfloat16")
DTYPE_CHOICES = (*DTYPES, "auto")
QUANTIZATION_CHOICES = ("auto", "none", "int8")  # stallfree/model/quant_load.py says what each does
# The KV cache's dtype (vLLM's --kv-cache-dtype): auto is the model's; int8 holds each
# (token, head) row as int8 values and a float32 scale (stallfree/model/kv_quant.py).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")
# Offered under vLLM's name, refused with the reason (kv_quant.py holds the layouts built).
KV_CACHE_FP8_REFUSAL = (
    "kv_cache_dtype fp8 is not built: it would take the bytes of int8 (1 per value and a "
    "float32 scale per token and head) and be less exact (e4m3 keeps 3 mantissa bits: on the "
    "default model's keys and values its error was 2-4x int8's), and no CPU kernel or torch "
    "path here computes in fp8; use int8")
DEFAULT_CPU_KV_BYTES = 1 << 30
DEFAULT_TOKEN_BUDGET = 512
# With --tbt-slo the SLO picks each iteration's budget; the budget is then only a cap,
# one high enough not to bind where an iteration of that many tokens meets any sane SLO.
SLO_TOKEN_BUDGET_CAP = 8192
CUDA_KV_FRACTION = 0.85  # of the accelerator memory free after loading weights


def option(default: Any = MISSING, help: str = "", *, flags: tuple[str, ...] = (),
           choices: tuple[str, ...] | None = None, parse: Callable[[str], Any] | None = None,
           aliases: tuple[str, ...] = (), nargs: str | None = None, metavar: str | None = None,
           default_factory: Any = MISSING) -> Any:
    """A config field with what the command line needs to offer it as a flag.

    `flags` default to `--field-name`; `parse` turns the flag's text into a value
    (raising ValueError); `aliases` are other keyword names `from_kwargs` accepts;
    `nargs` and `metavar` are argparse's.
    """
    metadata = {"help": help, "flags": flags, "choices": choices, "parse": parse,
                "aliases": aliases, "nargs": nargs, "metavar": metavar}
    return field(default=default, default_factory=default_factory, metadata=metadata)


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12,
          "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}


def parse_size(text: str) -> int:
    """'512MiB', '2GB', '1073741824' -> bytes."""
    match = _SIZE.match(text)
    if not match:
        raise ValueError(f"not a memory size: {text!r} (try 512MiB or 2GiB)")
    unit = (match.group(2) or "").lower().rstrip("b")
    return int(float(match.group(1)) * _UNITS[unit])


def _check_positive_ints(config: object, *names: str) -> None:
    for name in names:
        value = getattr(config, name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")


def parse_seconds(text: str) -> float:
    """'0.2' -> 0.2; anything else is a ValueError naming what was expected."""
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"not a number of seconds: {text!r}") from None


def _check_positive_number(config: object, name: str, what: str = "number") -> None:
    value = getattr(config, name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) \
            or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive {what}, got {value!r}")


@dataclass
class SchedulerConfig:
    policy: str = option("sarathi", "scheduling rule", choices=POLICIES)
    # None resolves in __post_init__: DEFAULT_TOKEN_BUDGET, or SLO_TOKEN_BUDGET_CAP with tbt_slo.
    token_budget: int | None = option(
        None, f"tokens computed per iteration; smaller = steadier TBT, more chunking overhead "
              f"(default {DEFAULT_TOKEN_BUDGET}; with --tbt-slo an upper cap, default "
              f"{SLO_TOKEN_BUDGET_CAP})",
        flags=("--max-num-batched-tokens", "--token-budget"), aliases=("max_num_batched_tokens",),
        parse=int)
    max_num_seqs: int = option(128, "requests running at once")
    max_model_len: int | None = option(
        None, "prompt + output limit per request (default: the model's own)", parse=int)
    tbt_slo: float | None = option(
        None, "time-between-tokens target in seconds (sarathi only): each iteration keeps every "
              "decode and adds prefill tokens only while its predicted time stays within "
              "tbt_slo x the margin; admission stops when the decode batch would not fit",
        parse=parse_seconds)
    tbt_slo_margin: float | None = option(
        None, "share of --tbt-slo an iteration's predicted time may fill, the rest absorbing "
              "prediction error (default: learned, 1 / the 99th percentile of the recent "
              "iterations' measured over predicted time, within [0.5, 0.95]; 0.8 until "
              "100 iterations are seen, and under pipeline parallelism, where iterations "
              "overlap and are not measured one by one)", parse=float)

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {', '.join(POLICIES)}, got {self.policy!r}")
        if self.token_budget is None:
            self.token_budget = DEFAULT_TOKEN_BUDGET if self.tbt_slo is None \
                else SLO_TOKEN_BUDGET_CAP
        _check_positive_ints(self, "token_budget", "max_num_seqs")
        if self.tbt_slo is not None:
            _check_positive_number(self, "tbt_slo", "number of seconds")
            if self.policy != "sarathi":
                raise ValueError(f"tbt_slo needs the sarathi policy, not {self.policy!r}")
        if self.tbt_slo_margin is not None:
            _check_positive_number(self, "tbt_slo_margin")
            if self.tbt_slo_margin > 1:
                raise ValueError(f"tbt_slo_margin must be in (0, 1], got "
                                 f"{self.tbt_slo_margin!r}")
        if self.max_model_len is not None:
            _check_positive_ints(self, "max_model_len")

    def resolved(self, model_limit: int) -> SchedulerConfig:
        """This config with max_model_len bounded by (or, unset, equal to) the model's limit."""
        limit = model_limit if self.max_model_len is None else min(self.max_model_len,
                                                                   model_limit)
        return dataclasses.replace(self, max_model_len=limit)


@dataclass
class CacheConfig:
    block_size: int = option(16, "tokens per KV block")
    kv_cache_memory: int | None = option(
        None, "KV cache size in bytes per rank, e.g. 1GiB "
              "(default: 1GiB on CPU, 85% of free memory on CUDA)", parse=parse_size)
    watermark: float = option(
        0.01, "fraction of KV blocks kept free when admitting, so running requests can grow")
    enable_prefix_caching: bool = option(
        True, "share the KV of full blocks between requests with the same prefix (vLLM's "
              "automatic prefix caching; on by default)", flags=("--enable-prefix-caching",))
    kv_cache_dtype: str = option(
        "auto", "KV cache storage; auto: the model's dtype; int8: int8 values with a float32 "
                "scale per token and head (3.8x the tokens of float32 at head_dim 64); fp8: "
                "not built (refused, with why)", choices=KV_CACHE_DTYPES)

    def __post_init__(self) -> None:
        _check_positive_ints(self, "block_size")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, "
                             f"got {self.kv_cache_dtype!r}")
        if self.kv_cache_dtype == "fp8":
            raise ValueError(KV_CACHE_FP8_REFUSAL)
        if self.kv_cache_memory is not None and self.kv_cache_memory <= 0:
            raise ValueError(f"kv_cache_memory must be positive, got {self.kv_cache_memory!r}")
        if not 0 <= self.watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark!r}")

    def kv_bytes(self, device_type: str, free_memory: int | None = None) -> int:
        """The KV budget in bytes: the one given, or the device's default share."""
        if self.kv_cache_memory is not None:
            return self.kv_cache_memory
        if device_type == "cuda":
            if free_memory is None:
                raise ValueError("the CUDA KV default needs the free accelerator memory")
            return int(free_memory * CUDA_KV_FRACTION)
        return DEFAULT_CPU_KV_BYTES


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = option(
        1, "split every layer over N worker processes", flags=("-tp", "--tensor-parallel-size"))
    pipeline_parallel_size: int = option(
        1, "split the layers into M pipeline stages (M micro-batches in flight)",
        flags=("-pp", "--pipeline-parallel-size"))
    # The other ranks join from other machines with `stallfree worker` (docs/parallelism.md).
    num_local_workers: int | None = option(
        None, "ranks started here (default: all); the rest join with `stallfree worker` "
              "from other machines", parse=int)
    startup_timeout: float = option(600.0, "seconds for every worker to load its shard",
                                    flags=("--worker-startup-timeout",))

    def __post_init__(self) -> None:
        _check_positive_ints(self, "tensor_parallel_size", "pipeline_parallel_size")
        local = self.num_local_workers
        if local is not None and not 0 <= local <= self.world_size:
            raise ValueError(f"num_local_workers must be in [0, {self.world_size}], got {local!r}")

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size


@dataclass
class EngineConfig:
    model: str | None = option(
        None, "GGUF file or Hugging Face directory (default: SmolLM2-135M-Instruct)")
    dtype: str | None = option(
        "auto", "weights and KV dtype; auto: bfloat16 on CUDA and on CPUs with fast bf16 "
                "(AMX or AVX512_BF16, confirmed by a timed matmul), float32 elsewhere",
        choices=DTYPE_CHOICES)
    quantization: str = option(
        "auto", "weights kept or made quantized; auto: a GGUF file's Q4_0/Q4_1/Q4_K/Q5_K/Q6_K/"
                "Q8_0 weights stay quantized where the quantized matmul kernel runs (CPU); "
                "none: dequantized to dtype at load; int8: every matmul weight as "
                "per-channel int8", choices=QUANTIZATION_CHOICES)
    device: str | None = option(None, "cpu, cuda, cuda:1 ... (default: cuda if available)")
    seed: int = option(0, "seed of unseeded sampling")
    threads: int | None = option(
        None, "CPU threads for the model's compute, per process (default: $OMP_NUM_THREADS, "
              "else the cores this process may run on)", parse=int)
    kernels: dict[str, str] = option(
        help="kernel table choices to override, e.g. decode_attention=torch (`stallfree info` "
             "shows the table): " + "; ".join(f"{o} {'|'.join(i)}" for o, i in KERNEL_OPS.items()),
        parse=parse_kernels, metavar="OP=IMPL,...", default_factory=dict)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)

    def __post_init__(self) -> None:
        if self.dtype is not None and self.dtype not in DTYPE_CHOICES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, "
                             f"got {self.dtype!r}")
        if self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_CHOICES)}, "
                             f"got {self.quantization!r}")
        if self.threads is not None:
            _check_positive_ints(self, "threads")
        self.kernels = check_kernels(self.kernels)

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineConfig:
        """Builds the config from flat keyword arguments named after any field (or alias)."""
        values = _split_by_owner(kwargs)
        sections = {name: section(**values.get(section, {}))
                    for name, section in _SECTIONS.items()}
        return cls(**values.get(cls, {}), **sections)

    def replace(self, **kwargs: Any) -> EngineConfig:
        """A copy with some flat settings changed (named as `from_kwargs` names them)."""
        values = _split_by_owner(kwargs)
        sections = {name: dataclasses.replace(getattr(self, name), **values.get(section, {}))
                    for name, section in _SECTIONS.items()}
        return dataclasses.replace(self, **values.get(EngineConfig, {}), **sections)


# EngineConfig's nested sections; their settings are flat keywords of LLM and flags of the CLI.
_SECTIONS: dict[str, type] = {"scheduler": SchedulerConfig, "cache": CacheConfig,
                              "parallel": ParallelConfig}


def setting_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of `cls` that are settings (made with `option`), not nested sections."""
    return [f for f in dataclasses.fields(cls) if "help" in f.metadata]


def engine_setting_fields() -> list[dataclasses.Field]:
    """Every flat engine setting, in flag order."""
    return [f for cls in (EngineConfig, *_SECTIONS.values()) for f in setting_fields(cls)]


def _split_by_owner(kwargs: dict[str, Any]) -> dict[type, dict[str, Any]]:
    owners = {}
    for cls in (EngineConfig, *_SECTIONS.values()):
        for f in setting_fields(cls):
            for key in (f.name, *f.metadata["aliases"]):
                owners[key] = (cls, f.name)
    values: dict[type, dict[str, Any]] = {}
    for key, value in kwargs.items():
        if key not in owners:
            raise ValueError(f"unknown engine setting {key!r}")
        cls, name = owners[key]
        if name in values.setdefault(cls, {}):
            raise ValueError(f"{key} is given twice (it is an alias of {name})")
        values[cls][name] = value
    return values


def resolve_device(name: str | None, cuda_available: bool) -> str:
    """The device to run on: the one named, else CUDA when there is one."""
    if name is None:
        return "cuda" if cuda_available else "cpu"
    return name


def dtype_needs_cpu_probe(name: str | None, device_type: str) -> bool:
    """Whether resolving `name` on `device_type` needs to know if the CPU's bf16 is fast."""
    return name in (None, "auto") and device_type == "cpu"


def resolve_dtype(name: str | None, device_type: str, cpu_bf16: tuple[bool, str] | None = None
                  ) -> tuple[str, str]:
    """The dtype of weights and KV cache (a `torch` attribute name) and why it was chosen.

    `cpu_bf16` is (fast, why) from measuring this CPU; needed when
    `dtype_needs_cpu_probe` says so.
    """
    if name not in (None, "auto"):
        if name not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPE_CHOICES)}, got {name!r}")
        return name, "given"
    if device_type != "cpu":
        return "bfloat16", f"auto on {device_type}"
    if cpu_bf16 is None:
        raise ValueError("dtype auto on CPU needs the CPU's bf16 probe")
    fast, why = cpu_bf16
    return ("bfloat16" if fast else "float32"), f"auto on cpu: {why}"


def resolve_threads(requested: int | None, env_value: str | None, available: int) -> int:
    """Compute threads: the ones asked for, else $OMP_NUM_THREADS, else every usable core."""
    if requested is not None:
        return requested
    if env_value and env_value.strip().isdigit() and int(env_value) > 0:
        return int(env_value)
    return max(1, available)
