"""SparseMoE's forward (stallfree/model/moe.py) against two dense SwiGLU MLPs: one of equal
active parameters (intermediate top_k * I: what a token's arithmetic costs) and one of
equal total parameters (intermediate num_experts * I: what reading every expert costs).

Run: nice -n 5 .venv/bin/python benchmarks/moe_step.py [--tokens 1 8 64] [--rounds 15]
     [--hidden 1024] [--intermediate 1408] [--experts 8] [--top-k 2] [--threads 2]
     [--dtype float32]

Defaults: a Qwen1.5-MoE-sized expert (H 1024, I 1408), 8 experts, top-2, float32, on two
threads. The three are timed in turn within every round (interleaved, so a load change
hits them alike); prints the median ms per forward and the MoE's time over each dense
one's, with the CPU's flags. At few tokens a MoE should cost about the active-size MLP
(it reads only its active experts); by 64 tokens every expert is active and it nears the
total-size one, plus its routing and per-expert dispatch.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stallfree.model.moe import SparseMoE


def cpu_flags() -> str:
    """The flags line of /proc/cpuinfo (empty where there is none)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def dense_mlp(hidden: int, intermediate: int,
              dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """A SwiGLU MLP as layers.SwiGLUMLP's torch path runs it: [gate; up] in one matmul."""
    gate_up = torch.randn(2 * intermediate, hidden, dtype=dtype) * hidden ** -0.5
    down = torch.randn(hidden, intermediate, dtype=dtype) * intermediate ** -0.5

    def forward(x: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, down)
    return forward


def build_moe(args: argparse.Namespace, dtype: torch.dtype) -> SparseMoE:
    moe = SparseMoE(args.hidden, args.intermediate, args.experts, args.top_k, True)
    with torch.no_grad():
        moe.router.weight.normal_(0, args.hidden ** -0.5)
        moe.experts_gate_up.normal_(0, args.hidden ** -0.5)
        moe.experts_down.normal_(0, args.intermediate ** -0.5)
    return moe.to(dtype).eval()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--calls", type=int, default=5, help="forwards per timed sample")
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--intermediate", type=int, default=1408)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    h, i = args.hidden, args.intermediate
    moe = build_moe(args, dtype)
    paths = {"moe": moe, "dense_active": dense_mlp(h, args.top_k * i, dtype),
             "dense_total": dense_mlp(h, args.experts * i, dtype)}
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}; "
          f"CPU flags: {cpu_flags()}")
    print(f"H {h}, I {i}, {args.experts} experts, top-{args.top_k}, {args.dtype}; "
          f"median ms per forward over {args.rounds} interleaved rounds of {args.calls}")
    print("| tokens | experts active | moe ms | dense active ms | dense total ms "
          "| moe / active | moe / total |")
    print("|---|---|---|---|---|---|---|")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, h, dtype=dtype)
            active = moe.route(x)[1].unique().numel()
            times: dict[str, list[float]] = {n: [] for n in paths}
            for round_ in range(args.rounds + 1):  # the first round warms up
                for name, fn in paths.items():
                    start = time.perf_counter()
                    for _ in range(args.calls):
                        fn(x)
                    if round_:
                        times[name].append((time.perf_counter() - start) / args.calls)
            med = {n: statistics.median(t) * 1e3 for n, t in times.items()}
            print(f"| {tokens} | {active} | {med['moe']:.3f} | {med['dense_active']:.3f} | "
                  f"{med['dense_total']:.3f} | {med['moe'] / med['dense_active']:.2f} | "
                  f"{med['moe'] / med['dense_total']:.2f} |", flush=True)


if __name__ == "__main__":
    main()
