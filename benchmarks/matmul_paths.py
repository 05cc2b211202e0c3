"""The matmul paths of stallfree/model/linear.py side by side, on the default model's
shapes: every layer's four weights (30 layers, 212 MB in bf16, read cold), at several row
counts.

Run: .venv/bin/python benchmarks/matmul_paths.py [--rows 1 8 32 512] [--rounds 5] [--gated]
     [--dtype float32]

Paths, timed in turn within every round (interleaved, so a load change hits them alike):
  amx      csrc/amx_linear.cpp on weights packed for the tile multiply: in AMX tiles, or in
           AVX512_BF16 vectors on CPUs without AMX (the first line printed says which)
  onednn   oneDNN's matmul on weights reordered once into its blocked layout
  skinny   csrc/skinny_linear.cpp (up to linear.SKINNY_MAX_TOKENS rows)
  torch    F.linear on the plain weight (oneDNN reorders it at every call)
--dtype float32: float32 weights, and the paths f32 (csrc/f32_linear.cpp on its packing),
onednn and torch.
In either dtype, also the weights kept quantized (csrc/quant_linear.cpp): q4_32 (GGUF's
Q4_1 values, 6 bits/weight) and q8_32 (int8 per output channel, 9 bits/weight).
Prints the median ms per pass over all 120 matrices, the weight bytes streamed per second
and the matmul rate, with the CPU's flags.
--gated: only the MLP's gate/up weights, each followed by SiLU x up: `fused` (the AMX
kernel with SiLU x up in its epilogue, linear.gated_linear) against `amx+torch` (the AMX
matmul storing [T, 2I], then torch's two ops, linear.silu_mul); in float32 the f32 kernel's
fused form against f32+torch.
"""
from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from stallfree.executor.hardware import vector_flags
from stallfree.model.kernels import amx_unavailable_reason, unavailable_reason
from stallfree.model.linear import (
    PACK_HINT_ROWS,
    SKINNY_MAX_TOKENS,
    gated_linear,
    pack_weight,
    pair_kernel_unavailable_reason,
    silu_mul,
)
from stallfree.model.loader import default_model_path, load_model_config
from stallfree.model.quant_formats import FORMATS, quantize_int8


def model_shapes() -> list[tuple[int, int]]:
    """(out, in) of one layer's qkv, o, gate_up and down projections."""
    c = load_model_config(default_model_path())
    qkv = (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
    return [(qkv, c.hidden_size), (c.hidden_size, c.num_attention_heads * c.head_dim),
            (2 * c.intermediate_size, c.hidden_size), (c.hidden_size, c.intermediate_size)]


Path = Callable[[torch.Tensor, int, int], object]  # (x, layer, weight) -> x @ W.T


def gated_paths(weights: list[list[torch.Tensor]], shapes: list[tuple[int, int]],
                dtype: torch.dtype) -> dict[str, Path]:
    kernel = "f32" if dtype == torch.float32 else "amx"
    if kernel == "amx" and pair_kernel_unavailable_reason() is not None:
        raise SystemExit(f"--gated needs the tile packing's kernel: "
                         f"{pair_kernel_unavailable_reason()}")
    if kernel == "f32" and unavailable_reason() is not None:
        raise SystemExit(f"--gated needs the kernels: {unavailable_reason()}")
    fused = [[pack_weight(w, gated=True) for w in layer] for layer in weights]
    plain = [[pack_weight(w) for w in layer] for layer in weights]
    matmul = getattr(torch.ops.stallfree, f"{kernel}_linear")
    return {"fused": lambda x, i, j: gated_linear(x, weights[i][j], fused[i][j]),
            f"{kernel}+torch": lambda x, i, j: silu_mul(matmul(x, plain[i][j].data,
                                                               shapes[j][0]))}


def plain_paths(weights: list[list[torch.Tensor]], shapes: list[tuple[int, int]],
                dtype: torch.dtype) -> dict[str, Path]:
    paths: dict[str, Path] = {}
    ops = torch.ops.stallfree
    if dtype == torch.float32 and unavailable_reason() is None:
        f32 = [[ops.f32_pack(w) for w in layer] for layer in weights]
        paths["f32"] = lambda x, i, j: ops.f32_linear(x, f32[i][j], shapes[j][0])
    elif dtype == torch.bfloat16 and pair_kernel_unavailable_reason() is None:
        amx = [[ops.amx_pack(w) for w in layer] for layer in weights]
        paths["amx"] = lambda x, i, j: ops.amx_linear(x, amx[i][j], shapes[j][0])
    onednn = [[torch.ops.mkldnn._reorder_linear_weight(w, PACK_HINT_ROWS) for w in layer]
              for layer in weights]
    paths["onednn"] = lambda x, i, j: torch.ops.mkldnn._linear_pointwise(
        x, onednn[i][j], None, "none", [], "")
    if dtype == torch.bfloat16 and unavailable_reason() is None:
        paths["skinny"] = lambda x, i, j: ops.skinny_linear(x, weights[i][j])
    paths["torch"] = lambda x, i, j: F.linear(x, weights[i][j])
    if unavailable_reason() is None:
        for fmt, quantize in (("q4_32", q4_rows), ("q8_32", quantize_int8)):
            code = FORMATS[fmt].code
            rows = [[ops.quant_pack_panels(quantize(w), w.shape[1], code) for w in layer]
                    for layer in weights]
            paths[fmt] = (lambda x, i, j, rows=rows, code=code:
                          ops.quant_linear(x, rows[i][j], *shapes[j], code))
    return paths


def q4_rows(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] as q4_32 rows: per group of 32, 4-bit values between the group's min and max
    (Q4_1's rule)."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // 32, 32)
    low, high = w.amin(-1, keepdim=True), w.amax(-1, keepdim=True)
    scale = (high - low) / 15
    q = torch.round((w - low) / torch.where(scale > 0, scale, 1)).clamp(0, 15).to(torch.uint8)
    packed = (q[..., :16] | (q[..., 16:] << 4)).reshape(n, k // 2)
    return torch.cat([packed, scale.reshape(n, -1).contiguous().view(torch.uint8),
                      low.reshape(n, -1).contiguous().view(torch.uint8)], dim=1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 4, 8, 16, 32, 64, 128, 512,
                                                            1024, 2048])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--gated", action="store_true",
                    help="gate/up weights only, SiLU x up fused vs after the matmul")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    args = ap.parse_args()
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype)
    shapes = model_shapes()
    if args.gated:
        shapes = shapes[2:3]
    weights = [[torch.randn(n, k, dtype=dtype) for n, k in shapes] for _ in range(args.layers)]
    nbytes = sum(w.nbytes for layer in weights for w in layer)
    paths = (gated_paths(weights, shapes, dtype) if args.gated
             else plain_paths(weights, shapes, dtype))
    flags = vector_flags()
    print(f"{torch.get_num_threads()} threads; CPU flags: {flags}; "
          f"AMX: {amx_unavailable_reason() or 'yes'}; the amx path in "
          f"{'tiles' if amx_unavailable_reason() is None else 'vectors'}")
    print(f"{args.layers} layers x {len(shapes)} weights {shapes}, {nbytes / 1e6:.0f} MB; "
          f"median ms per pass of {args.rounds} interleaved rounds")
    names = list(paths)
    print("| rows | " + " | ".join(names) + " | fastest | its GB/s | its GFLOP/s |")
    print("|---" * (len(names) + 4) + "|")
    for rows in args.rows:
        xs = [torch.randn(rows, k, dtype=dtype) for _, k in shapes]
        active = [n for n in names if n != "skinny" or rows <= SKINNY_MAX_TOKENS]
        times: dict[str, list[float]] = {n: [] for n in active}
        for round_ in range(args.rounds + 1):  # the first round warms up
            for name in active:
                start = time.perf_counter()
                for i in range(args.layers):
                    for j in range(len(shapes)):
                        paths[name](xs[j], i, j)
                if round_:
                    times[name].append(time.perf_counter() - start)
        med = {n: statistics.median(t) for n, t in times.items()}
        best = min(med, key=med.get)
        print(f"| {rows} | " + " | ".join(f"{med[n] * 1e3:.2f}" if n in med else "-"
                                          for n in names)
              + f" | {best} | {nbytes / med[best] / 1e9:.1f} | "
              f"{2 * rows * nbytes / dtype.itemsize / med[best] / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()
