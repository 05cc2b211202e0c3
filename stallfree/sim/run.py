"""Glue between the simulator and the benchmark code: one simulated `bench serve` run -> report.

The workload, the per-request records, the report and the capacity search
are the benchmark's own (`stallfree.bench`); only the server is replaced by
the simulator, so a simulated report has exactly the keys of a measured one
(backend "simulator", base_url "sim://...", plus a "simulation" section).
"""
from __future__ import annotations

import dataclasses
import itertools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..bench.capacity import SLO_BUDGET, Budget, check_slo_budget
from ..bench.config import PERCENTILES, BenchConfig, ClientConfig, SLOs
from ..bench.report import compute_report, report_header
from ..bench.workload import WorkloadConfig, build_workload
from ..config import (
    DEFAULT_CPU_KV_BYTES,
    SLO_TOKEN_BUDGET_CAP,
    CacheConfig,
    SchedulerConfig,
    option,
    parse_size,
)
from .cost_model import CostModel, ProfiledCostModel
from .hardware import GPUS, MODELS, get_gpu, get_model, kv_cache_blocks
from .profile_store import PROFILE_ROOT
from .simulator import SimConfig, simulate

CALIBRATIONS = ("none", "yi34b")


@dataclass
class Deployment:
    """A simulated replica: model on hardware, its parallelism and its cost model settings."""

    model: str = option("mistral-7b", f"{', '.join(MODELS)}, or a Hugging Face config.json")
    gpu: str = option("a100", "simulated accelerator", choices=(*GPUS, "cpu"))
    tp: int = option(1, "tensor-parallel degree")
    pp: int = option(1, "pipeline stages")
    node: str | None = option(None, "network profile (default: the GPU's pairwise one)")
    profile_dir: str | None = option(
        None, "profile root (default: shipped profiles; `stallfree profile` writes one)")
    # What-if / cross-check.
    roofline: bool = option(False, "ignore compute profiles")
    calibration: str = option("none", "add the CPU overhead fitted to the paper's Yi-34B "
                              "iterations", choices=CALIBRATIONS)
    block_size: int = option(CacheConfig.block_size, "tokens per KV block")
    watermark: float = option(CacheConfig.watermark,
                              "fraction of KV blocks kept free when admitting")
    enable_prefix_caching: bool = option(
        CacheConfig.enable_prefix_caching, "share the KV of repeated prefixes, as the engine "
        "does (on by default)", flags=("--enable-prefix-caching",))
    gpu_memory_utilization: float = option(0.9, "share of GPU memory the engine may use")
    kv_cache_memory: int | None = option(
        None, "KV cache bytes per rank, e.g. 1GiB (default: from GPU memory)", parse=parse_size)
    cpu_slowdown: float | None = option(
        None, "--gpu cpu: wall seconds per CPU second of the engine (default: the profile's "
              "host.json; 1 = a core of its own)")

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError("--tp and --pp must be >= 1")
        if self.calibration not in CALIBRATIONS:
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
                     percentiles: tuple[float, ...] = PERCENTILES, detail: bool = True,
                     max_duration: float | None = None) -> BenchConfig:
    """The BenchConfig a `bench serve` run against the simulated server would have."""
    client = ClientConfig(base_url=deployment.url, model=deployment.model,
                          max_duration=max_duration, progress=False)
    return BenchConfig(workload, client, slos, tbt_slo_ms, percentiles, scrape_metrics=False,
                       detail=detail, label=label)


def run_simulated_benchmark(cfg: BenchConfig, sched: SchedulerConfig, deployment: Deployment,
                            cost: CostModel | None = None, token_salt: int = 0) -> dict[str, Any]:
    """`bench.run.run_benchmark`, with the simulator in place of the client and server."""
    cost = cost or deployment.cost_model()
    specs = build_workload(cfg.workload, token_salt)
    sim_cfg = SimConfig(sched, deployment.num_blocks(sched), deployment.block_size,
                        deployment.watermark, cfg.client.max_duration,
                        enable_prefix_caching=deployment.enable_prefix_caching)
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


def simulation_line(sim: dict[str, Any]) -> str:
    """A simulated report's `simulation` section in one line."""
    return (f"simulated {sim['iterations']} iterations in {sim['wall_s']:.1f} s; "
            f"{sim['num_kv_blocks']} KV blocks; {sim['num_preemptions']} preemptions; stages "
            f"busy {sim['stage_busy_fraction']:.0%}, idle while in flight (bubbles) "
            f"{sim['pipeline_bubble_fraction']:.0%}")


def default_max_model_len(value: int | None) -> int:
    # The paper's sharegpt runs use max_seq_len 8192 (its longest request is 8149 tokens).
    return 8192 if value is None else value


@dataclass
class Setup:
    """A scheduler under test. With `targets_slo` (a token budget of `slo`) its tbt_slo is
    the TBT SLO under test, set by `at_slo`: a capacity search runs once per SLO."""

    label: str
    scheduler: SchedulerConfig
    targets_slo: bool = False

    def at_slo(self, slo: float | None) -> SchedulerConfig:
        """The scheduler config of a run under the TBT SLO `slo` (None: none given)."""
        if not self.targets_slo:
            return self.scheduler
        if slo is None:
            raise ValueError(f"{self.label} targets the TBT SLO under test: give --tbt-slo")
        return dataclasses.replace(self.scheduler, tbt_slo=slo)


def scheduler_setups(systems: list[tuple[str, Budget | None, int | None]], policies: list[str],
                     budgets: list[Budget], max_num_seqs: int,
                     max_model_len: int | None) -> list[Setup]:
    """The setup of each (policy, budget, max seqs) system, or else of each policy x budget;
    a budget or max seqs not given is the policy's default. A budget of `slo` is sarathi
    with the SLO under test as its target, capped at SLO_TOKEN_BUDGET_CAP tokens."""
    max_len = default_max_model_len(max_model_len)
    specs = systems or [(p, b, None) for p, b in itertools.product(policies, budgets)]
    out = []
    for policy, budget, seqs in specs:
        # vLLM and Orca run whole prefills: their budget defaults to max_model_len (vLLM's rule).
        budget = budget or (budgets[0] if policy in ("sarathi", "chunked_only") else max_len)
        check_slo_budget(policy, budget)
        tokens = SLO_TOKEN_BUDGET_CAP if budget == SLO_BUDGET else int(budget)
        cfg = SchedulerConfig(policy, tokens, seqs or max_num_seqs, max_len)
        size = SLO_BUDGET if budget == SLO_BUDGET else f"b{cfg.token_budget}"
        out.append(Setup(f"sim-{cfg.policy}-{size}-s{cfg.max_num_seqs}", cfg,
                         budget == SLO_BUDGET))
    return out
