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
ratio of those medians (this tree / REV: below 1 is faster), and each pair's ratio.
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

ROOT = Path(__file__).resolve().parents[1]


def measure(batches: list[int], rounds: int) -> None:
    """In a child process: `rounds` step medians per batch, as one JSON line."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from stallfree import LLM, huge_pages  # before torch loads: as `stallfree serve` runs

    # isort: split
    from engine_speed import decode_step_seconds

    llm = LLM(max_model_len=4096)
    ms = {b: [decode_step_seconds(llm, b, 512, steps=24) * 1e3 for _ in range(rounds)]
          for b in batches}
    print("RESULT " + json.dumps({"ms": ms, "huge_pages_mib": huge_pages.huge_page_mib()}),
          flush=True)


def run_side(tree: Path, build: Path | None, batches: str, rounds: int) -> dict:
    """One measuring process on `tree`'s code: {"ms": {batch: [ms...]}, "huge_pages_mib"}."""
    env = dict(os.environ)
    if build is not None:  # the baseline: its package first on the path, its own kernels
        env.update(PYTHONPATH=str(tree), STALLFREE_BUILD_DIR=str(build))
    out = subprocess.run([sys.executable, __file__, "--measure", "--batches", batches,
                          "--rounds", str(rounds)], cwd=tree, env=env, check=True,
                         capture_output=True, text=True).stdout
    line = next(ln for ln in out.splitlines() if ln.startswith("RESULT "))
    result = json.loads(line.removeprefix("RESULT "))
    result["ms"] = {int(b): ms for b, ms in result["ms"].items()}
    return result


def baseline_tree(rev: str, folder: Path) -> tuple[Path, Path]:
    """REV checked out under `folder`, its kernels built beside it: (tree, build folder)."""
    tree, build = folder / "tree", folder / "build"
    subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], cwd=ROOT,
                   check=True, capture_output=True)
    built = subprocess.run([sys.executable, "-m", "stallfree.model.kernel_build"], cwd=tree,
                           env=dict(os.environ, PYTHONPATH=str(tree),
                                    STALLFREE_BUILD_DIR=str(build)),
                           capture_output=True, text=True)
    if built.returncode != 0:
        raise SystemExit(f"the kernels of {rev} did not build:\n{built.stderr[-2000:]}")
    print(built.stdout.strip().splitlines()[-1], flush=True)
    return tree, build


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
    from stallfree.executor.hardware import cpu_flags

    flags = sorted(f for f in cpu_flags() if f.startswith(("avx", "amx", "fma")))
    print(f"CPU flags: {' '.join(flags)}; baseline {args.baseline_rev}, {args.pairs} pairs of "
          f"{args.rounds} rounds")
    with tempfile.TemporaryDirectory(prefix="engine_ab_") as tmp:
        tree, build = baseline_tree(args.baseline_rev, Path(tmp))
        try:
            sides: dict[str, list[dict]] = {"base": [], "this": []}
            for pair in range(args.pairs):
                order = ("base", "this") if pair % 2 == 0 else ("this", "base")
                for side in order:
                    sides[side].append(run_side(tree if side == "base" else ROOT,
                                                build if side == "base" else None,
                                                args.batches, args.rounds))
                this, base = sides["this"][-1], sides["base"][-1]
                print(f"pair {pair + 1}: " + ", ".join(
                    f"batch {b}: {statistics.median(this['ms'][b]):.2f} against "
                    f"{statistics.median(base['ms'][b]):.2f} ms" for b in batches)
                    + f" (huge pages {this['huge_pages_mib']:.0f} / "
                    f"{base['huge_pages_mib']:.0f} MiB)", flush=True)
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=ROOT,
                           check=False)
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
