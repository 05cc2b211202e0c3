"""What the engine's process holds in memory on the default model, per dtype.

Run: .venv/bin/python benchmarks/process_memory.py [--dtypes bfloat16 float32]
     [--quantizations auto none] [--kv-cache-memory 1GiB] [--model PATH]

Each dtype and `quantization` setting runs in a child process of its own (peak memory is
per process): it loads the model, generates 32 tokens, and reports the kernel's counts for
the process (VmHWM, the peak resident set; VmRSS, the resident set at the end) beside what
the model holds: its weights as held, their packings for the CPU kernels (quantized ones
included), the plain matrices kept beside those (linear.repack drops them where a packing
serves every call), and the KV cache.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys

from stallfree.config import parse_size

MB = 1e6


def _status_kb(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise KeyError(field)


def measure(dtype: str, quantization: str, kv_cache_memory: int,
            model: str | None = None) -> dict[str, float]:
    """In this process: load, generate, and count."""
    from stallfree import LLM, SamplingParams

    llm = LLM(model, dtype=dtype, kv_cache_memory=kv_cache_memory, quantization=quantization,
              max_model_len=2048)
    llm.generate(["Name three colours."], SamplingParams(max_tokens=32, ignore_eos=True))
    model = llm.engine.executor.model
    held = model.held_bytes()
    return {"weights": sum(held.values()) / MB,
            "packings": held["packings"] / MB, "plain kept": held["plain beside packings"] / MB,
            "kv cache": llm.engine.executor.runner.kv_cache.nbytes / MB,
            "VmHWM": _status_kb("VmHWM") * 1e3 / MB, "VmRSS": _status_kb("VmRSS") * 1e3 / MB}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtypes", nargs="+", default=["bfloat16", "float32"])
    parser.add_argument("--quantizations", nargs="+", default=["auto"])
    parser.add_argument("--kv-cache-memory", default="1GiB",
                        help="KV cache size (bytes, or e.g. 512MiB)")
    parser.add_argument("--model", default=None, help="GGUF or HF directory (default model)")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        dtype, _, quantization = args.child.partition(":")
        print(json.dumps(measure(dtype, quantization, parse_size(args.kv_cache_memory),
                                 args.model)))
        return
    from stallfree.executor.hardware import vector_flags

    flags = vector_flags()
    print(f"CPU flags: {flags}; KV cache {args.kv_cache_memory}; "
          f"model {args.model or 'the default'}")
    columns = ["weights", "packings", "plain kept", "kv cache", "VmHWM", "VmRSS"]
    print("| dtype | quantization | " + " | ".join(f"{c} MB" for c in columns) + " |")
    print("|---" * (len(columns) + 2) + "|")
    for dtype in args.dtypes:
        for quantization in args.quantizations:
            out = subprocess.run([sys.executable, __file__, "--child",
                                  f"{dtype}:{quantization}",
                                  "--kv-cache-memory", args.kv_cache_memory,
                                  *(["--model", args.model] if args.model else [])],
                                 capture_output=True, text=True, check=True, timeout=600)
            row = json.loads(out.stdout.strip().splitlines()[-1])
            print(f"| {dtype} | {quantization} | "
                  + " | ".join(f"{row[c]:.0f}" for c in columns) + " |", flush=True)


if __name__ == "__main__":
    main()
