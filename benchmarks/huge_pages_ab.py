"""The engine with and without huge pages for torch's big CPU buffers, side by side.

Run: .venv/bin/python benchmarks/huge_pages_ab.py [--rounds 4] [--quick]

torch reads THP_MEM_ALLOC_ENABLE once, as it loads, so each measurement is a fresh
process: the rounds alternate a process with it 0 and one with it 1 (the order flips
every round), and the table gives the median of each and their ratio. A process measures
decode steps at 512-token contexts and prefill tokens/s in 512- and 2048-token chunks,
with the engine_speed.py functions.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics

from ab_processes import alternating, run_child

from stallfree.executor.hardware import vector_flags
from stallfree.huge_pages import TORCH_SWITCH, huge_page_mib, status, thp_mode

BATCHES = (1, 8, 32)
CHUNKS = (512, 2048)


def child(quick: bool) -> None:
    from engine_speed import decode_step_seconds, prefill_tokens_per_second

    from stallfree import LLM

    llm = LLM(max_model_len=4096)
    row: dict[str, float | str | None] = {"huge_pages": status(), "dtype": str(llm.engine.dtype)}
    for batch in BATCHES[:2] if quick else BATCHES:
        row[f"decode b{batch} ms"] = decode_step_seconds(llm, batch, 512, steps=8) * 1e3
    for chunk in CHUNKS:
        row[f"prefill {chunk} tok/s"] = prefill_tokens_per_second(llm, chunk, 2048)
    row["huge MiB"] = huge_page_mib()
    print(json.dumps(row), flush=True)


def run_once(on: bool, quick: bool) -> dict:
    env = {**os.environ, TORCH_SWITCH: "1" if on else "0"}
    return run_child([__file__, "--child"] + ["--quick"] * quick, env)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--quick", action="store_true", help="batches 1 and 8 only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.quick)
    print(f"CPU flags: {vector_flags()}\nTHP mode: {thp_mode()}; {args.rounds} rounds, "
          "each a fresh process per setting")
    runs: dict[bool, list[dict]] = {False: [], True: []}
    for r, on in alternating(args.rounds, False, True):
        runs[on].append(run_once(on, args.quick))
        print(f"round {r + 1}, huge pages {'on' if on else 'off'}: {runs[on][-1]}", flush=True)
    keys = [k for k in runs[True][0] if k.endswith(("ms", "tok/s"))]
    print(f"\n{runs[True][0]['dtype']}; on: {runs[True][0]['huge_pages']}, "
          f"{runs[True][0]['huge MiB']} MiB in huge pages; off: {runs[False][0]['huge MiB']}")
    print("| measure | 4 KiB pages | huge pages | gain |\n|---|---|---|---|")
    for key in keys:
        off, on = (statistics.median(run[key] for run in runs[s]) for s in (False, True))
        gain = off / on if key.endswith("ms") else on / off  # >1: huge pages are faster
        print(f"| {key} | {off:.1f} | {on:.1f} | {gain:.2f}x |")


if __name__ == "__main__":
    main()
