"""PNG plots of benchmark reports (`bench serve`) and capacity results (`bench capacity`).

- `tbt_cdf.png`: CDF of every TBT gap, one line per system (log x: stalls are
  orders of magnitude above a normal gap, and the tail is the point).
- `vs_rate.png`: P99 TBT and median/P99 TTFT against the request rate, from the
  capacity trials, with the SLO drawn.
- `capacity.png`: capacity bars per system, grouped by TBT SLO.
- `timeline_<label>.png`: per-request token timeline; gaps above the stall
  threshold in red, so stalls line up across requests when a prefill blocks
  every decode (vLLM/Orca) and are absent under stall-free batching.
- `budget_<log>.png`, from a server's `--iteration-log` under `--tbt-slo`: the token
  budget the SLO gave each iteration, and its measured and predicted time beside the
  SLO and the target (SLO x margin).
"""
from __future__ import annotations

import json
import os
from typing import Any

import numpy as np

Report = dict[str, Any]


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def load(path: str) -> Report:
    with open(path) as f:
        return json.load(f)


def is_capacity(obj: Report) -> bool:
    return obj.get("kind") == "capacity"


def _label(rep: Report, path: str) -> str:
    return rep.get("label") or os.path.splitext(os.path.basename(path))[0]


def tbt_gaps(rep: Report) -> np.ndarray:
    """Every TBT gap (s) of the successful requests of a report with token times."""
    gaps = []
    for ok, times in zip(rep.get("success", []), rep.get("token_times", [])):
        if ok and len(times) > 1:
            gaps.append(np.diff(times))
    return np.concatenate(gaps) if gaps else np.zeros(0)


def plot_tbt_cdf(reports: dict[str, Report], path: str, slo_ms: float | None = None) -> None:
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, rep in reports.items():
        gaps = np.sort(tbt_gaps(rep)) * 1000.0
        if len(gaps):
            # Zero gaps (tokens of one chunk) cannot sit on a log axis: floor them at 0.01 ms.
            ax.step(np.maximum(gaps, 1e-2), np.arange(1, len(gaps) + 1) / len(gaps),
                    where="post", label=f"{label} (P99 {np.percentile(gaps, 99):.0f} ms)")
    if slo_ms:
        ax.axvline(slo_ms, color="k", ls="--", lw=1, label=f"SLO {slo_ms:g} ms")
    ax.set_xscale("log")
    ax.set_xlabel("time between tokens (ms)")
    ax.set_ylabel("fraction of gaps")
    ax.set_ylim(0, 1.01)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=8)
    ax.set_title("TBT distribution (every gap)")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _searches(capacity: list[Report]) -> list[tuple[str, float, Report]]:
    """(system label, TBT SLO in s, search result) of every search in the capacity files."""
    return [(sys_["label"], res["criterion"]["tbt_slo_s"], res)
            for cap in capacity for sys_ in cap.get("systems", []) for res in sys_["results"]]


def _trials_by_system(capacity: list[Report]) -> dict[str, list[Report]]:
    """Each system's trials, one per rate (the searches of several SLOs share them; a
    system targeting the SLO under test has a line per target)."""
    out: dict[str, dict[float, Report]] = {}
    for cap in capacity:
        for sys_ in cap.get("systems", []):
            target = sys_.get("tbt_slo_target_s")
            label = sys_["label"] + ("" if target is None else f" @ {target * 1e3:g} ms")
            for res in sys_["results"]:
                for t in res["trials"]:
                    out.setdefault(label, {})[t["rate"]] = t
    return {label: [trials[r] for r in sorted(trials)] for label, trials in out.items()}


def plot_vs_rate(capacity: list[Report], path: str) -> None:
    plt = _plt()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.5))
    for label, trials in _trials_by_system(capacity).items():
        rates = [t["rate"] for t in trials]
        line, = ax1.plot(rates, [t["metrics"].get("p99_tbt_ms") for t in trials], "o-",
                         label=label)
        color = line.get_color()
        ax2.plot(rates, [t["metrics"].get("median_ttft_ms") for t in trials], "o-",
                 color=color, label=f"{label} median")
        ax2.plot(rates, [t["metrics"].get("p99_ttft_ms") for t in trials], "x--",
                 color=color, label=f"{label} P99")
    for slo in sorted({slo for _, slo, _ in _searches(capacity)}):
        ax1.axhline(slo * 1000.0, color="k", ls="--", lw=1)
    for ax, what in ((ax1, "P99 TBT (ms)"), (ax2, "TTFT (ms)")):
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7)
    ax1.set_title("P99 TBT vs rate (dashed: SLOs)")
    ax2.set_title("TTFT vs rate")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def capacity_label(search: dict[str, Any]) -> str:
    """A search's capacity as its bar says it: ">=" where it never failed (it passed at its
    max_rate or stopped early), "<" where it never passed (failed down to its lowest rate)."""
    capacity, upper = search["capacity_qps"], search.get("upper_qps")
    if upper is None:
        return f">={capacity:.2f}"
    if capacity <= 0:
        return f"<{upper:.2f}"
    return f"{capacity:.2f}"


def plot_capacity_bars(capacity: list[Report], path: str) -> None:
    plt = _plt()
    searches = _searches(capacity)
    slos = sorted({slo for _, slo, _ in searches})
    labels = list(dict.fromkeys(label for label, _, _ in searches))
    values = {(slo, label): res["capacity_qps"] for label, slo, res in searches}
    texts = {(slo, label): capacity_label(res) for label, slo, res in searches}
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(labels) * len(slos)), 4.5))
    width = 0.8 / max(1, len(labels))
    for j, label in enumerate(labels):
        xs = np.arange(len(slos)) + j * width
        bars = ax.bar(xs, [values.get((slo, label), 0.0) for slo in slos], width, label=label)
        ax.bar_label(bars, [texts.get((slo, label), "") for slo in slos], fontsize=7)
    ax.set_xticks(np.arange(len(slos)) + width * (len(labels) - 1) / 2)
    ax.set_xticklabels([f"P99 TBT <= {s * 1000:g} ms" for s in slos])
    ax.set_ylabel("capacity (req/s)")
    ax.set_title("Capacity per system and SLO")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_timeline(rep: Report, path: str, max_requests: int = 40,
                  stall_ms: float | None = None) -> None:
    """One row per request: a dot per token, red segments over gaps > stall_ms."""
    plt = _plt()
    gaps = tbt_gaps(rep)
    if stall_ms is None:  # the report's SLO, else 5x the median gap
        stall_ms = rep.get("tbt_slo_ms") or (5 * float(np.median(gaps)) * 1000 if len(gaps)
                                             else 1000.0)
    rows = [(i, s, t) for i, (s, t) in enumerate(zip(rep.get("send_times", []),
                                                     rep.get("token_times", [])))
            if s is not None and t][:max_requests]
    fig, ax = plt.subplots(figsize=(11, max(3, 0.18 * len(rows) + 1.5)))
    for y, (_, send, times) in enumerate(rows):
        ax.plot([send, times[0]], [y, y], color="0.75", lw=1)  # waiting for the first token
        ax.plot(times, [y] * len(times), "|", color="C0", ms=4)
        t = np.asarray(times)
        big = np.nonzero(np.diff(t) * 1000.0 > stall_ms)[0]
        for k in big:
            ax.plot([t[k], t[k + 1]], [y, y], color="red", lw=2.5)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([str(i) for i, _, _ in rows], fontsize=6)
    ax.set_xlabel("time since the start of the run (s)")
    ax.set_ylabel("request")
    ax.set_title(f"{rep.get('label') or ''} token timeline: grey = waiting for the first token,"
                 f" red = gap > {stall_ms:.0f} ms")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_budget(path: str, out: str, tbt_slo_ms: float | None = None) -> None:
    """Chosen budget and iteration times over a run, from an iteration log."""
    from ..iteration_log import read_iteration_log
    from ..outputs import iteration_period

    settings, records = read_iteration_log(path)
    records = [r for r in records if r.token_budget is not None]
    if not records:
        raise ValueError(f"{path}: no iteration has a token budget (a run without --tbt-slo?)")
    t0 = records[0].start
    times = np.array([r.start - t0 for r in records])
    plt = _plt()
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(9, 6), sharex=True)
    top.plot(times, [r.token_budget for r in records], lw=0.8, label="token budget")
    top.plot(times, [r.num_prefill_tokens + r.num_decode_tokens for r in records], lw=0.6,
             alpha=0.7, label="tokens computed")
    top.set_ylabel("tokens per iteration")
    top.legend(loc="upper right")
    # What the model learns and predicts: each iteration's period (start to next start).
    nexts = [r.start for r in records[1:]] + [None]
    bottom.plot(times, [1e3 * iteration_period(r.start, r.end, n)
                        for r, n in zip(records, nexts)], lw=0.6, label="measured")
    bottom.plot(times, [1e3 * r.predicted_time for r in records], lw=0.6, alpha=0.8,
                label="predicted")
    slo = tbt_slo_ms or (1e3 * settings["tbt_slo"] if settings.get("tbt_slo") else None)
    if slo:
        bottom.axhline(slo, color="red", ls="--", lw=1, label=f"SLO {slo:.0f} ms")
    # Each iteration's target (SLO x margin): it moves with a learned margin and with
    # requests' own SLOs (logs from before it was recorded have none).
    if all(r.target_time is not None for r in records):
        bottom.plot(times, [1e3 * r.target_time for r in records], color="orange", ls=":",
                    lw=1, label="target")
    bottom.set_ylabel("iteration period (ms)")
    bottom.set_xlabel("seconds since the first iteration")
    bottom.legend(loc="upper right")
    fig.tight_layout()
    fig.savefig(out, dpi=120)
    plt.close(fig)


def _is_iteration_log(path: str) -> bool:
    with open(path) as f:
        first = f.readline()
    return first.startswith('{"iteration_log"')


def plot_all(paths: list[str], out_dir: str, tbt_slo_ms: float | None = None) -> list[str]:
    """Every plot the given files allow; returns the PNG paths written."""
    os.makedirs(out_dir, exist_ok=True)
    reports: dict[str, Report] = {}
    capacity: list[Report] = []
    written = []
    for path in paths:
        if _is_iteration_log(path):
            name = os.path.splitext(os.path.basename(path))[0]
            written.append(os.path.join(out_dir, f"budget_{name}.png"))
            plot_budget(path, written[-1], tbt_slo_ms)
            continue
        obj = load(path)
        if is_capacity(obj):
            capacity.append(obj)
        else:
            reports[_label(obj, path)] = obj
    if reports:
        slo = tbt_slo_ms or next((r.get("tbt_slo_ms") for r in reports.values()
                                  if r.get("tbt_slo_ms")), None)
        written.append(os.path.join(out_dir, "tbt_cdf.png"))
        plot_tbt_cdf(reports, written[-1], slo)
        for label, rep in reports.items():
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)
            written.append(os.path.join(out_dir, f"timeline_{safe}.png"))
            plot_timeline(rep, written[-1], stall_ms=tbt_slo_ms)
    if capacity:
        written.append(os.path.join(out_dir, "vs_rate.png"))
        plot_vs_rate(capacity, written[-1])
        written.append(os.path.join(out_dir, "capacity.png"))
        plot_capacity_bars(capacity, written[-1])
    return written
