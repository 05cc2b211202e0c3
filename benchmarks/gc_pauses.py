"""Python's full GC passes in a loaded server: start-up objects frozen (the default) and not.

Run: .venv/bin/python benchmarks/gc_pauses.py [--duration 540] [--rate 10] [--rounds 1]
Each arm starts `stallfree serve` on the default model, with a hook on the server's path
that logs every collection's generation and duration (gc.callbacks, from a sitecustomize
written to a temporary directory), loads it with `stallfree bench serve` (random 64-token
prompts, 32 outputs each) at --rate requests/s for --duration seconds, stops it by its PID,
and reports the full (generation 2) passes that ran under the load beside the TBT tail.
The arms alternate, the order flipping every round (ab_processes.py). STALLFREE_GC_FREEZE=0
is the unfrozen arm.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from ab_processes import alternating

from stallfree.bench.systems import ServerProcess, System
from stallfree.server.serve import GC_FREEZE_SWITCH

HOOK = '''import gc, os, time
_log = open(os.environ["GC_PASS_LOG"], "a", buffering=1)
_start = [0.0]
def _timed(phase, info):
    if phase == "start":
        _start[0] = time.perf_counter()
    else:
        _log.write(f"{time.time():.3f} {info['generation']} "
                   f"{(time.perf_counter() - _start[0]) * 1e3:.2f}\\n")
gc.callbacks.append(_timed)
'''


def run_arm(freeze: bool, rate: float, duration: int, workdir: str) -> dict:
    """One server under load; its full passes during the load and its TBT tail."""
    passes_log = os.path.join(workdir, f"passes-{int(freeze)}-{time.time():.0f}.log")
    command = [sys.executable, "-m", "stallfree", "serve", "--host", "127.0.0.1",
               "--port", "{port}", "--uvicorn-log-level", "warning"]
    env = {"HF_HUB_OFFLINE": "1", "PYTHONPATH": workdir, "GC_PASS_LOG": passes_log,
           GC_FREEZE_SWITCH: "1" if freeze else "0"}
    server = ServerProcess(System("gc-frozen" if freeze else "gc-unfrozen", command=command,
                                  env=env), log_dir=workdir)
    result_file = os.path.join(workdir, "result.json")
    try:
        load_start = time.time()
        subprocess.run([sys.executable, "-m", "stallfree", "bench", "serve",
                        "--base-url", server.base_url, "--dataset", "random",
                        "--random-input-len", "64", "--random-output-len", "32",
                        "--num-prompts", str(int(rate * duration) + 1),
                        "--request-rate", str(rate), "--max-duration", str(duration),
                        "--disable-tqdm", "--no-detail", "--result-file", result_file],
                       check=True, stdout=subprocess.DEVNULL)
    finally:
        server.stop()
    with open(passes_log) as f:
        rows = [line.split() for line in f]
    full = [float(ms) for at, gen, ms in rows if gen == "2" and float(at) >= load_start]
    with open(result_file) as f:
        result = json.load(f)
    return {"full": full, "p99_tbt": result["p99_tbt_ms"], "stall": result["max_tbt_ms"],
            "completed": result["completed"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=int, default=540, help="seconds of load per arm")
    parser.add_argument("--rate", type=float, default=10.0, help="requests per second")
    parser.add_argument("--rounds", type=int, default=1, help="alternations of the two arms")
    args = parser.parse_args()
    print(f"full GC passes under {args.rate:g} requests/s for {args.duration} s, per arm")
    print("| start-up objects | requests | full passes | each pass ms | P99 TBT ms "
          "| longest stall ms |\n|---|---:|---:|---|---:|---:|")
    with tempfile.TemporaryDirectory() as workdir:
        with open(os.path.join(workdir, "sitecustomize.py"), "w") as f:
            f.write(HOOK)
        for _, freeze in alternating(args.rounds, False, True):
            arm = run_arm(freeze, args.rate, args.duration, workdir)
            each = ", ".join(f"{ms:.0f}" for ms in sorted(arm["full"])) or "-"
            print(f"| {'frozen' if freeze else 'left to the GC'} | {arm['completed']} "
                  f"| {len(arm['full'])} | {each} | {arm['p99_tbt']:.0f} "
                  f"| {arm['stall']:.0f} |", flush=True)


if __name__ == "__main__":
    main()
