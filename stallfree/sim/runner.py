"""Glue between the simulator and the benchmark code: one simulated `bench serve` run -> report.

The workload, the per-request records, the report and the capacity search
are the benchmark's own (`stallfree.bench`); only the server is replaced by
the simulator, so a simulated report has exactly the keys of a measured one
(backend "simulator", base_url "sim://...", plus a "simulation" section).
"""
from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.client import ClientConfig
from ..bench.metrics import SLOs, compute_report
from ..bench.runner import BenchConfig, report_header
from ..bench.workload import WorkloadConfig, build_workload
from ..config import DEFAULT_CPU_KV_BYTES, SchedulerConfig
from .cost_model import CostModel, ProfiledCostModel
from .hardware import get_gpu, get_model, kv_cache_blocks
from .profiles import PROFILE_ROOT
from .simulator import SimConfig, simulate



@dataclass
class Deployment:
    """A simulated replica: model on hardware, its parallelism and its cost model settings."""

    model: str = "mistral-7b"
    gpu: str = "a100"
    tp: int = 1
    pp: int = 1
    node: str | None = None
    profile_dir: str | None = None
    roofline: bool = False  # ignore the compute profiles (what-if / cross-check)
    calibration: str = "none"  # "yi34b": add the CPU overhead fitted to the paper's Yi-34B
    block_size: int = 16
    watermark: float = 0.01
    gpu_memory_utilization: float = 0.9
    kv_cache_memory: int | None = None
    cpu_slowdown: float | None = None  # wall per CPU second (default: the profile's host.json)

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError("--tp and --pp must be >= 1")
        if self.calibration not in ("none", "yi34b"):
            raise ValueError(f"calibration must be none or yi34b, got {self.calibration!r}")

    @property
    def url(self) -> str:
        return f"sim://{self.model}/{self.gpu}/tp{self.tp}-pp{self.pp}"

    def cost_model(self) -> ProfiledCostModel:
        extra = (0.0, 0.0)
        if self.calibration == "yi34b":
            from .calibrate import fit_overhead

            extra = fit_overhead()
        mode = "roofline" if self.roofline else "auto"
        return ProfiledCostModel(get_model(self.model), get_gpu(self.gpu), self.tp, self.pp,
                                 self.node, Path(self.profile_dir or PROFILE_ROOT), mode, mode,
                                 extra, self.cpu_slowdown, self.block_size)

    def num_blocks(self, sched: SchedulerConfig) -> int:
        gpu = get_gpu(self.gpu)
        kv_memory = self.kv_cache_memory
        if kv_memory is None and gpu.name == "cpu":
            kv_memory = DEFAULT_CPU_KV_BYTES
        return kv_cache_blocks(get_model(self.model), gpu, self.tp, self.pp, self.block_size,
                               self.gpu_memory_utilization, sched.token_budget, kv_memory,
                               dtype_bytes=4 if gpu.name == "cpu" else 2)  # CPU runs fp32

    def describe(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def sim_bench_config(workload: WorkloadConfig, deployment: Deployment, label: str | None = None,
                     slos: SLOs | None = None, tbt_slo_ms: float | None = None,
                     percentiles: tuple[float, ...] = (50, 90, 99), detail: bool = True,
                     max_duration: float | None = None) -> BenchConfig:
    """The BenchConfig a `bench serve` run against the simulated server would have."""
    client = ClientConfig(base_url=deployment.url, model=deployment.model,
                          max_duration=max_duration, progress=False)
    return BenchConfig(workload, client, slos, tbt_slo_ms, percentiles, scrape_metrics=False,
                       detail=detail, label=label)


def run_simulated_benchmark(cfg: BenchConfig, sched: SchedulerConfig, deployment: Deployment,
                            cost: CostModel | None = None, token_salt: int = 0) -> dict[str, Any]:
    """`runner.run_benchmark`, with the simulator in place of the client and server."""
    cost = cost or deployment.cost_model()
    specs = build_workload(cfg.workload, token_salt)
    sim_cfg = SimConfig(sched, deployment.num_blocks(sched), deployment.block_size,
                        deployment.watermark, cfg.client.max_duration)
    wall = time.perf_counter()
    result = simulate(specs, sim_cfg, cost)
    report = report_header(cfg, specs, time.time(), backend="simulator")
    report |= compute_report(result.run, cfg.slos, cfg.percentiles, cfg.detail, cfg.tbt_slo_ms)
    report["simulation"] = {
        "scheduler": dataclasses.asdict(sched), "deployment": deployment.describe(),
        "cost_model": cost.describe(), **result.summary(),
        "wall_s": round(time.perf_counter() - wall, 3),
    }
    return report


def with_rate(cfg: BenchConfig, rate: float) -> BenchConfig:
    return dataclasses.replace(cfg, workload=dataclasses.replace(cfg.workload, request_rate=rate))


def default_max_model_len(value: int | None) -> int:
    # The paper's sharegpt runs use max_seq_len 8192 (its longest request is 8149 tokens).
    return 8192 if value is None else value
