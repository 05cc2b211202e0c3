"""Decode steps of this tree against another git revision's, in alternated processes.

Run: .venv/bin/python benchmarks/engine_ab.py --baseline-rev REV [--batches 1,32]
[--pairs 6] [--rounds 3]

For a change that no switch turns off (engine_speed.py --kernel-ab needs one): REV is
checked out in a temporary git worktree, its CPU kernels built into a folder of their own,
and each pair of processes runs the same measurement (engine_speed.decode_step_seconds, the
default model, 512-token contexts) once on REV's code and once on this tree's, the order
alternating between pairs. A shared machine's speed swings by 10-20% within minutes; the
pairs spread both sides over the same minutes, and the per-pair ratios show how far the
swing reaches. Prints, per batch: the median ms per step of every round on each side, the
ratio of those medians (this tree / REV: below 1 is faster), and each pair's ratio. Both
sides must run their CPU kernels (`make kernels` builds this tree's); REV needs the
kernel build folder switch (STALLFREE_BUILD_DIR) and the API engine_speed.py uses.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from ab_processes import alternating, run_child

ROOT = Path(__file__).resolve().parents[1]


def measure(batches: list[int], rounds: int) -> None:
    """In a child process: `rounds` step medians per batch, as one JSON line. Only what
    every recent revision has is imported: this runs on the baseline's code too (and
    engine_speed imports stallfree before torch, as `stallfree serve` does)."""
    from engine_speed import decode_step_seconds

    from stallfree import LLM, huge_pages
    from stallfree.model.kernels import unavailable_reason

    llm = LLM(max_model_len=4096)
    ms = {b: [decode_step_seconds(llm, b, 512, steps=24) * 1e3 for _ in range(rounds)]
          for b in batches}
    print(json.dumps({"ms": ms, "huge_pages_mib": huge_pages.huge_page_mib(),
                      "kernels": unavailable_reason() or "loaded"}), flush=True)


def run_side(tree: Path, build: Path | None, batches: str, rounds: int) -> dict:
    """One measuring process on `tree`'s code: {"ms": {batch: [ms...]}, "huge_pages_mib",
    "kernels"}; stops the comparison where that tree's kernels did not load."""
    env = dict(os.environ, PYTHONPATH=str(tree))  # ahead of the editable install
    if build is not None:
        env["STALLFREE_BUILD_DIR"] = str(build)
    result = run_child([__file__, "--measure", "--batches", batches, "--rounds", str(rounds)],
                       env, cwd=tree)
    if result["kernels"] != "loaded":
        raise SystemExit(f"the CPU kernels of {tree} did not load: {result['kernels']}")
    result["ms"] = {int(b): ms for b, ms in result["ms"].items()}
    return result


def add_baseline_tree(rev: str, tree: Path, build: Path) -> None:
    """REV checked out at `tree`, its kernels built into `build`."""
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT,
                   check=True, capture_output=True)
    built = subprocess.run([sys.executable, "-m", "stallfree.model.kernel_build"], cwd=tree,
                           env=dict(os.environ, PYTHONPATH=str(tree),
                                    STALLFREE_BUILD_DIR=str(build)),
                           capture_output=True, text=True)
    if not list(build.glob("kernels_*/kernels.so")):  # the build reports failure, exit 0
        raise SystemExit(f"the kernels of {rev} did not build:\n{built.stderr[-2000:]}")
    print(f"kernels of {rev} built in {build}", flush=True)


def mib(value: float | None) -> str:
    return "?" if value is None else f"{value:.0f}"


def compare(args: argparse.Namespace, tree: Path, build: Path) -> dict[str, list[dict]]:
    sides: dict[str, list[dict]] = {"base": [], "this": []}
    for pair, side in alternating(args.pairs, "base", "this"):
        sides[side].append(run_side(tree if side == "base" else ROOT,
                                    build if side == "base" else None,
                                    args.batches, args.rounds))
        if len(sides["base"]) == len(sides["this"]):
            this, base = sides["this"][-1], sides["base"][-1]
            print(f"pair {pair + 1}: " + ", ".join(
                f"batch {b}: {statistics.median(this['ms'][b]):.2f} against "
                f"{statistics.median(base['ms'][b]):.2f} ms" for b in this["ms"])
                + f" (huge pages {mib(this['huge_pages_mib'])} / "
                f"{mib(base['huge_pages_mib'])} MiB)", flush=True)
    return sides


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baseline-rev", help="the git revision to compare against")
    parser.add_argument("--batches", default="1,32", help="decode batch sizes, comma-separated")
    parser.add_argument("--pairs", type=int, default=6, help="pairs of processes")
    parser.add_argument("--rounds", type=int, default=3, help="step medians per process")
    parser.add_argument("--measure", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.measure:
        return measure(batches, args.rounds)
    if not args.baseline_rev or args.pairs < 1 or args.rounds < 1:
        parser.error("--baseline-rev is required; --pairs and --rounds at least 1")
    from stallfree.executor.hardware import vector_flags  # this tree's, in this process

    print(f"CPU flags: {vector_flags()}; baseline {args.baseline_rev}, {args.pairs} pairs of "
          f"{args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="engine_ab_") as tmp:
        tree, build = Path(tmp) / "tree", Path(tmp) / "build"
        try:
            add_baseline_tree(args.baseline_rev, tree, build)
            sides = compare(args, tree, build)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False, capture_output=True)
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=False)
    print("\n| batch | this tree ms/step | baseline ms/step | this / baseline | each pair |")
    print("|---|---|---|---|---|")
    for b in batches:
        this = statistics.median(ms for run in sides["this"] for ms in run["ms"][b])
        base = statistics.median(ms for run in sides["base"] for ms in run["ms"][b])
        each = " ".join(f"{statistics.median(t['ms'][b]) / statistics.median(s['ms'][b]):.3f}"
                        for t, s in zip(sides["this"], sides["base"]))
        print(f"| {b} | {this:.2f} | {base:.2f} | {this / base:.3f} | {each} |")


if __name__ == "__main__":
    main()
