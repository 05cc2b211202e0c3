"""Linear layers whose few-token bfloat16 matmuls run in the CPU kernel
(csrc/skinny_linear.cpp).

A decode step's matmuls have one row of x per sequence. At a few rows torch's bf16 matmul
on CPU streams the weights at about half the read bandwidth; the kernel streams them at
nearly all of it (docs/benchmarks.md: "Few-token bf16 matmuls"), so a bf16 decode step is
near its memory floor. Above SKINNY_MAX_TOKENS rows the weights are reused enough that
torch's blocked matmul (AMX where the CPU has it) is faster, and faster still from weights
reordered once, at load, into oneDNN's blocked layout (`pack_weight`): F.linear on a plain
bf16 weight reorders it on every call, which at 8-128 rows costs a third of the time
(docs/benchmarks.md: "Prepacked bf16 weights"). Everything else goes to F.linear, the
reference. STALLFREE_SKINNY_LINEAR=0 / STALLFREE_PACKED_LINEAR=0 turn either path off.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .kernels import KernelSwitch

# Measured crossover on a 2-core AVX-512 CPU (model shapes, weights read cold): the kernel
# takes 0.57-0.65x torch's time at 1-4 rows and breaks even at 8.
SKINNY_MAX_TOKENS = 4
SWITCH = KernelSwitch("STALLFREE_SKINNY_LINEAR")
PACKED = KernelSwitch("STALLFREE_PACKED_LINEAR", needs_library=False)
# oneDNN picks its blocking for this many rows; measured: as fast as a per-size packing
# at 8-128 rows and the fastest at a 512-token prefill chunk.
PACK_HINT_ROWS = 512


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] reordered for oneDNN's matmul, or None where that path is not
    used (not a CPU bf16 weight, no oneDNN, or the switch is off). The copy costs the
    weight's size again in memory; it is built after loading, so KV sizing sees it."""
    if (weight.device.type != "cpu" or weight.dtype != torch.bfloat16 or weight.dim() != 2
            or not PACKED.usable() or not torch.backends.mkldnn.is_available()):
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_HINT_ROWS)
    except (AttributeError, RuntimeError):  # a torch build without the op
        return None


def runs_in_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= SKINNY_MAX_TOKENS and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.is_contiguous() and SWITCH.usable())


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           packed: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [T, in], in the kernel or from `packed` (the
    `pack_weight` of `weight`) where either pays."""
    if runs_in_kernel(x, weight):
        out = torch.ops.stallfree.skinny_linear(x, weight)
        return out if bias is None else out + bias
    if packed is not None and PACKED.enabled and x.dim() == 2 and x.dtype == packed.dtype:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), packed, bias, "none", [], "")
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) calling `linear`."""

    # Not a parameter or buffer: checkpoints and module moves never see it. `prepack`
    # sets it once the weight holds its final values.
    packed: torch.Tensor | None = None

    def prepack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)
