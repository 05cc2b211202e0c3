"""One round of the simulator's validation on this CPU (docs/simulation.md, "Validation
against the real engine on a CPU"), as one bounded command.

A fresh profile of this machine, then per request rate: a fresh server logging every
iteration (engine on one core, one thread), `bench serve` on the other core, the same
workload simulated from the profile, and the served iterations replayed through the cost
model. It prints one markdown row per rate: median TBT, P99 TBT and median TTFT measured
against simulated, and the replay's error on decode-only and prefill iterations.

  .venv/bin/python benchmarks/sim_validation.py [--dtype float32] [--rates 0.3,0.6,1.0]

Everything lands in --out (profile, bench and simulation reports, iteration logs, server
logs). A step past its bound stops the round with the step's name.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from stallfree.bench.systems import ServerProcess, System
from stallfree.config import DTYPE_CHOICES
from stallfree.sim.calibrate import VALIDATION_KEYS, validation_errors

MODEL, BUDGET, MAX_LEN = "smollm2-135m", 512, 2048
WORKLOAD = ["--dataset", "sharegpt", "--seed", "1", "--length-scale", "0.125",
            "--max-model-len", str(MAX_LEN)]


def stallfree(core: int, *args: str) -> list[str]:
    return ["taskset", "-c", str(core), sys.executable, "-m", "stallfree", *args]


def step(name: str, argv: list[str], limit: float, log: str, ok: tuple[int, ...] = (0,)) -> None:
    """Runs one command to its end within `limit` seconds, its output in `log`."""
    with open(log, "w") as out:
        try:
            done = subprocess.run(argv, stdout=out, stderr=subprocess.STDOUT, timeout=limit)
        except subprocess.TimeoutExpired:
            sys.exit(f"{name}: past its bound of {limit:.0f} s (log: {log})")
    if done.returncode not in ok:
        sys.exit(f"{name}: exit status {done.returncode} (log: {log})")


def served(args: argparse.Namespace, rate: str, out: str) -> None:
    """One server for one rate, loaded by `bench serve` on the other core."""
    cmd = stallfree(args.engine_core, "serve", "--host", "127.0.0.1", "--port", "{port}",
                    "--policy", "sarathi", "--token-budget", str(BUDGET),
                    "--max-model-len", str(MAX_LEN), "--dtype", args.dtype,
                    "--iteration-log", f"{out}/iters_{rate}.jsonl",
                    "--uvicorn-log-level", "warning")
    system = System(f"serve-{rate}", command=cmd)  # the round's environment: offline, 1 thread
    with ServerProcess(system, startup_timeout=120, log_dir=out) as server:
        step(f"bench serve at {rate} req/s",
             stallfree(args.client_core, "bench", "serve", "--base-url", server.base_url,
                       *WORKLOAD, "--num-prompts", str(args.num_prompts),
                       "--request-rate", rate, "--disable-tqdm",
                       "--result-file", f"{out}/real_{rate}.json"),
             args.rate_limit, f"{out}/bench_{rate}.log")


def simulated(args: argparse.Namespace, rate: str, out: str) -> None:
    cost = ["--gpu", "cpu", "--profile-dir", f"{out}/profile", "--model", MODEL]
    step(f"simulate at {rate} req/s",
         stallfree(args.client_core, "simulate", *cost, "--policy", "sarathi",
                   "--token-budget", str(BUDGET), *WORKLOAD,
                   "--num-prompts", str(args.num_prompts), "--request-rate", rate,
                   "--result-file", f"{out}/sim_{rate}.json"),
         300, f"{out}/sim_{rate}.log", ok=(0, 1))  # 1: not every simulated request finished
    step(f"replay at {rate} req/s",
         stallfree(args.client_core, "simulate", *cost, "replay",
                   f"{out}/iters_{rate}.jsonl", "--result-file", f"{out}/replay_{rate}.json"),
         300, f"{out}/replay_{rate}.log")


def row(rate: str, out: str) -> str:
    def load(name: str) -> dict:
        with open(f"{out}/{name}_{rate}.json") as f:
            return json.load(f)

    real, sim, rep = load("real"), load("sim"), load("replay")
    cells = [f"{m:.1f} / {s:.1f} ({err:+.1%})" if err is not None else f"{m} / {s}"
             for _, m, s, err in validation_errors(real, sim)]
    errors = {r["batches"]: r["error"] for r in rep["rows"]}
    replayed = ", ".join(f"{errors[k]:+.1%}" if errors.get(k) is not None else "-"
                         for k in ("decode-only", "with prefill"))
    return f"| {rate} | " + " | ".join(cells) + f" | {replayed} |"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dtype", default="auto", choices=DTYPE_CHOICES)
    p.add_argument("--rates", default="0.3,0.6,1.0")
    p.add_argument("--num-prompts", type=int, default=60)
    p.add_argument("--engine-core", type=int, default=1)
    p.add_argument("--client-core", type=int, default=0)
    p.add_argument("--rate-limit", type=float, default=900, help="seconds per served run")
    p.add_argument("--out", default="out/sim_validation")
    args = p.parse_args()
    out = os.path.abspath(f"{args.out}/{args.dtype}")
    os.makedirs(out, exist_ok=True)
    os.environ.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    start = time.monotonic()
    step("profile", stallfree(args.engine_core, "profile", "--out", f"{out}/profile",
                              "--dtype", args.dtype), 600, f"{out}/profile.log")
    rates = args.rates.split(",")
    for rate in rates:
        served(args, rate, out)
        simulated(args, rate, out)
    header = " | ".join(name for _, name in VALIDATION_KEYS)
    print(f"dtype {args.dtype}; measured / simulated ms (error); {time.monotonic() - start:.0f} s")
    print(f"| rate | {header} | replay: decode-only, with prefill |")
    print("|---:|" + "---:|" * (len(VALIDATION_KEYS) + 1))
    for rate in rates:
        print(row(rate, out))


if __name__ == "__main__":
    main()
