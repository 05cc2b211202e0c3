"""Linear layers whose bfloat16 matmuls run in the CPU kernels (csrc/amx_linear.cpp,
csrc/skinny_linear.cpp) or from weights prepacked for oneDNN, where that pays.

A decode step's matmuls have one row of x per sequence: they must stream the weights once.
On a CPU with AMX, the weights are reordered once, at load, into the tile multiply's
layout, and the AMX kernel runs every bf16 matmul up to AMX_MAX_ROWS rows: it streams the
weights at 1-32 rows as fast as the few-row kernel does at one, where oneDNN read them at
about half the bandwidth (docs/benchmarks.md: "AMX matmuls"), and it is as fast as oneDNN
at a 512-row prefill chunk. A CPU with AVX512_BF16 but no AMX runs the same kernel on the
same packing in vector dot products of bf16 pairs (csrc/pair_linear_vec.h): 1.3-1.6x
faster than oneDNN at 8-64 rows on a 2-core EPYC, and as fast at 512. Without either,
few-row bf16 matmuls (up to SKINNY_MAX_TOKENS) run in the skinny kernel, which widens bf16
to fp32 vectors, and more rows go to oneDNN from weights reordered once into its blocked
layout (`pack_weight`): F.linear on a plain bf16 weight reorders it on every call, which at
8-128 rows costs a third of the time (docs/benchmarks.md: "Prepacked bf16 weights").
float32 weights (rows in 16s) are packed for csrc/f32_linear.cpp, which runs their
matmuls: on a 2-core EPYC it took 0.37-0.5x F.linear's time at 1-8 rows and 0.74-0.85x at
512, in AVX-512 and AVX2 builds (docs/benchmarks.md: "float32 matmuls in a CPU kernel").
Weights kept quantized (packing.PackedWeight.quant: GGUF's 4- and 8-bit types, int8) run
in csrc/quant_linear.cpp at every row count, or are dequantized per call for F.linear.
Everything else goes to F.linear, the reference. Which of these paths runs is the kernel
table's choice (kernel_table.py: matmul_bf16, matmul_bf16_few_rows, matmul_f32), made at
load: the weights are packed for it.
"""
from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from torch import nn

from .kernel_table import PAIR_KERNEL, KernelTable, ensure
from .kernels import (
    amx_unavailable_reason,
    bf16_vectors_unavailable_reason,
    onednn_bf16_unavailable_reason,
)
from .packing import BLOCK, PackedWeight, gate_up_alternating

__all__ = ["AMX_MAX_ROWS", "SKINNY_MAX_TOKENS", "GatedLinear", "Linear", "PackedWeight",
           "gated_linear", "linear", "onednn_bf16_unavailable_reason", "pack_weight",
           "pair_kernel_max_rows", "pair_kernel_unavailable_reason", "repack", "silu_mul"]

# Measured crossover on a 2-core AVX-512 CPU (model shapes, weights read cold): the kernel
# takes 0.57-0.65x torch's time at 1-4 rows and breaks even at 8.
SKINNY_MAX_TOKENS = 4
# Measured on a 2-core AMX CPU (model shapes, 30 layers' weights): the AMX kernel takes
# 0.7-0.95x oneDNN's time at 1-512 rows and 1.2-1.35x at 2048, where oneDNN's blocking
# reuses x better; torch's matmul (which reorders the plain weight) takes those. In vectors
# there is no such limit (pair_kernel_max_rows).
AMX_MAX_ROWS = 1024
# oneDNN picks its blocking for this many rows; measured: as fast as a per-size packing
# at 8-128 rows and the fastest at a 512-token prefill chunk.
PACK_HINT_ROWS = 512


def pair_kernel_unavailable_reason() -> str | None:
    """Why the kernel of the tile packing (csrc/amx_linear.cpp) cannot run here (None: it
    can): it runs in tiles where the CPU has AMX and the OS lets this process use the tile
    registers, else in AVX512_BF16 vectors where the CPU has those."""
    amx, vectors = amx_unavailable_reason(), bf16_vectors_unavailable_reason()
    return None if amx is None or vectors is None else f"{amx}; {vectors}"


@functools.cache
def pair_kernel_max_rows() -> int:
    """Rows up to which a matmul runs in the tile packing's kernel: AMX_MAX_ROWS in tiles, any
    number in vectors. On a 2-core EPYC the vector path was as fast as oneDNN's prepacked
    matmul at 1024-2048 rows and 1.17x faster than torch's (docs/benchmarks.md), which is
    what a weight packed for the kernel falls back to, with SiLU x up unfused."""
    return AMX_MAX_ROWS if amx_unavailable_reason() is None else sys.maxsize


def runs_packed(rows: int, kernels: KernelTable) -> bool:
    """Whether a matmul of `rows` rows runs in the tile packing's kernel (its weight packed
    for it): the table's choice, and the row count within pair_kernel_max_rows."""
    return kernels.matmul_bf16.impl in PAIR_KERNEL and rows <= pair_kernel_max_rows()


def _amx_shape(weight: torch.Tensor) -> bool:
    return weight.shape[0] % BLOCK == 0 and weight.shape[1] % 32 == 0


def _pack_f32(weight: torch.Tensor, gated: bool) -> PackedWeight | None:
    if weight.shape[0] % BLOCK:
        return None
    if gated and weight.shape[0] % (2 * BLOCK) == 0:  # else halves not in whole blocks: plain
        return PackedWeight(torch.ops.stallfree.f32_pack(gate_up_alternating(weight)),
                            "f32_gated", tuple(weight.shape))
    return PackedWeight(torch.ops.stallfree.f32_pack(weight), "f32", tuple(weight.shape))


def pack_weight(weight: torch.Tensor, gated: bool = False,
                kernels: KernelTable | None = None) -> PackedWeight | None:
    """`weight` [out, in] reordered for the kernel the table (default: `default_kernels`)
    chose: a bf16 one for the tile packing's kernel where its shape fits, else for oneDNN's
    matmul where oneDNN takes bf16; a float32 one for the float32 kernel. None where none
    is used (another dtype or device, or the table chose torch). `repack`
    drops the plain weight where the packing serves every call; else the copy costs the
    weight's size again in memory (built after loading, so KV sizing sees it). `gated`: the
    weight is [gate; up] (`gated_linear`), packed with its gate and up blocks of 16 rows
    alternating."""
    kernels = ensure(kernels)
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    if weight.dtype == torch.float32:
        return _pack_f32(weight, gated) if kernels.matmul_f32.kernel else None
    impl = kernels.matmul_bf16.impl
    if weight.dtype != torch.bfloat16 or impl == "torch":
        return None
    pairs = impl in PAIR_KERNEL and _amx_shape(weight)
    if pairs and gated and weight.shape[0] % 64 == 0:
        return PackedWeight(torch.ops.stallfree.amx_pack(gate_up_alternating(weight)),
                            "amx_gated", tuple(weight.shape))
    if pairs:
        return PackedWeight(torch.ops.stallfree.amx_pack(weight), "amx", tuple(weight.shape))
    # oneDNN: the choice, or the tile kernel's fallback for shapes it cannot take.
    if onednn_bf16_unavailable_reason() is not None:
        return None
    try:
        return PackedWeight(torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(),
                                                                    PACK_HINT_ROWS), "onednn",
                            tuple(weight.shape))
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def quant_linear(x: torch.Tensor, packed: PackedWeight, bias: torch.Tensor | None,
                 kernels: KernelTable, gated: bool = False) -> torch.Tensor:
    """x @ W.T (gated: silu(gate) * up) from quantized rows, in x's dtype."""
    n, k = packed.shape
    if kernels.matmul_quant.kernel and x.device.type == "cpu" and x.dim() == 2:
        if gated and not fuses_quant_gate(packed):
            return silu_mul(quant_linear(x, packed, None, kernels))
        op = (torch.ops.stallfree.quant_linear_silu_mul if gated
              else torch.ops.stallfree.quant_linear)
        out = op(x, packed.data, n, k, packed.quant.code)
        return out if bias is None else out + bias
    out = F.linear(x, packed.unpack().to(x.dtype), bias)
    return silu_mul(out) if gated else out


def fuses_quant_gate(packed: PackedWeight) -> bool:
    """Whether a quantized [gate; up] runs with SiLU x up fused: its up rows must start a
    panel of 8 rows (csrc/quant_panels.h), so the gate's count must be a multiple of 8."""
    return packed.shape[0] % 16 == 0


def serves_every_call(packed: PackedWeight | None) -> bool:
    """Whether `packed` runs every matmul of its weight while its kernel is switched on, at
    any row count, so that the plain copy can go (`repack`): the float32 packings, and the
    tile packing where its kernel runs in vectors (in AMX tiles it leaves matmuls of more
    than AMX_MAX_ROWS rows to torch, which reads the plain weight)."""
    if packed is None or not packed.readable:
        return False
    return (packed.quant is not None or packed.layout.startswith("f32")
            or pair_kernel_max_rows() == sys.maxsize)


def plain_weight(weight: torch.Tensor | None, packed: PackedWeight | None) -> torch.Tensor:
    """`weight`, or where `repack` dropped it (None), its values read back from `packed`: a
    copy per call, for the paths that run only while a kernel is switched off (comparisons,
    benchmarks)."""
    if weight is not None:
        return weight
    if packed is None:
        raise ValueError("a dropped weight needs its packing")
    return packed.unpack()


def repack(module: nn.Module, previous: PackedWeight | None, gated: bool = False,
           kernels: KernelTable | None = None) -> PackedWeight | None:
    """`module.weight` packed (`pack_weight`; read back from `previous` where an earlier call
    dropped it). The plain weight is kept only where the packing does not serve every call;
    else `module.weight` becomes None: one copy of the weights in memory, not two, and any
    torch op handed the dropped weight fails instead of reading nothing."""
    plain = plain_weight(module.weight, previous)
    packed = pack_weight(plain, gated, kernels)
    module.weight = (None if serves_every_call(packed)
                     else nn.Parameter(plain, requires_grad=False))
    return packed


def runs_in_kernel(x: torch.Tensor, weight: torch.Tensor, kernels: KernelTable) -> bool:
    return (kernels.matmul_bf16_few_rows.kernel and x.dim() == 2
            and x.shape[0] <= SKINNY_MAX_TOKENS and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.is_contiguous())


def linear(x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None = None,
           packed: PackedWeight | None = None,
           kernels: KernelTable | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [T, in], in the kernel the table (default:
    `default_kernels`) chose or from `packed` (the `pack_weight` of `weight`) where either
    pays. `weight` None: dropped by `repack`."""
    kernels = ensure(kernels)
    if packed is not None and packed.quant is not None:
        return quant_linear(x, packed, bias, kernels)
    packed_fits = packed is not None and x.dim() == 2 and x.dtype == packed.data.dtype
    if packed_fits and packed.layout == "amx" and runs_packed(x.shape[0], kernels):
        out = torch.ops.stallfree.amx_linear(x, packed.data, packed.shape[0])
    elif packed_fits and packed.layout == "f32" and kernels.matmul_f32.kernel:
        out = torch.ops.stallfree.f32_linear(x, packed.data, packed.shape[0])
    else:
        weight = plain_weight(weight, packed)
        out = (torch.ops.stallfree.skinny_linear(x, weight)
               if runs_in_kernel(x, weight, kernels) else None)
    if out is not None:  # the kernels take no bias
        return out if bias is None else out + bias
    if packed_fits and packed.layout == "onednn" and kernels.matmul_bf16.kernel:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed.data, bias, "none",
                                                  [], "")
    return F.linear(x, weight, bias)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """[T, 2I] (gate | up) -> silu(gate) * up [T, I] in two torch ops: where the AMX
    kernel's fused form does not run (`gated_linear`), and the reference it is held to."""
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def fuses_gate(packed: PackedWeight | None, rows: int, kernels: KernelTable) -> bool:
    """Whether `gated_linear` runs x of `rows` rows in a kernel's fused form."""
    if packed is None:
        return False
    return (packed.layout == "amx_gated" and runs_packed(rows, kernels)
            or packed.layout == "f32_gated" and kernels.matmul_f32.kernel)


def gated_linear(x: torch.Tensor, weight: torch.Tensor | None,
                 packed: PackedWeight | None = None,
                 kernels: KernelTable | None = None) -> torch.Tensor:
    """silu(x @ gate.T) * (x @ up.T) for weight = [gate; up] [2I, in]. From a gated packing,
    in one AMX pass that never stores the [T, 2I] products: at a 512-token chunk those
    and the two torch ops reading them back cost as much as the matmul's arithmetic."""
    kernels = ensure(kernels)
    if packed is not None and packed.quant is not None:
        return quant_linear(x, packed, None, kernels, gated=True)
    if (x.dim() == 2 and fuses_gate(packed, x.shape[0], kernels)
            and x.dtype == packed.data.dtype):
        fused = (torch.ops.stallfree.f32_linear_silu_mul if packed.layout == "f32_gated"
                 else torch.ops.stallfree.amx_linear_silu_mul)
        return fused(x, packed.data, packed.shape[0])
    if packed is not None and packed.layout.endswith("_gated"):
        return silu_mul(linear(x, plain_weight(weight, packed), kernels=kernels))
    return silu_mul(linear(x, weight, None, packed, kernels))


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) calling `linear`. After `prepack`,
    `weight` is None where the packing alone holds it (`repack`); the packing is no
    parameter, so module moves (`.to`, `.float`) are for before `prepack` only."""

    # Not a parameter or buffer: checkpoints and module moves never see it. `prepack`
    # sets it once the weight holds its final values.
    packed: PackedWeight | None = None
    # The table the weight was packed for (None: `default_kernels`); set by `prepack`.
    kernels: KernelTable | None = None

    gated = False  # the weight is [gate; up] (GatedLinear)

    def prepack(self, kernels: KernelTable | None = None) -> None:
        self.kernels = ensure(kernels)
        if self.packed is not None and self.packed.quant is not None:
            return  # quantized at load, and kept so on every table (its torch path dequantizes)
        self.packed = repack(self, self.packed, self.gated, self.kernels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed, self.kernels)


class GatedLinear(Linear):
    """gate and up projections in one Linear ([gate; up], the checkpoint's fused name) whose
    forward is `gated_linear`: silu(gate) * up [T, I]."""

    gated = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return gated_linear(x, self.weight, self.packed, self.kernels)
