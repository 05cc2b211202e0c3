"""Linear layers whose few-token bfloat16 matmuls run in the CPU kernel
(csrc/skinny_linear.cpp).

A decode step's matmuls have one row of x per sequence. At a few rows torch's bf16 matmul
on CPU streams the weights at about half the read bandwidth; the kernel streams them at
nearly all of it (docs/benchmarks.md: "Few-token bf16 matmuls"), so a bf16 decode step is
near its memory floor. Above SKINNY_MAX_TOKENS rows the weights are reused enough that
torch's blocked matmul (AMX where the CPU has it) is faster. Everything else, and any
weight the kernel does not take, goes to F.linear, the reference.
STALLFREE_SKINNY_LINEAR=0 turns the kernel off.
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


def runs_in_kernel(x: torch.Tensor, weight: torch.Tensor) -> bool:
    return (x.dim() == 2 and x.shape[0] <= SKINNY_MAX_TOKENS and x.device.type == "cpu"
            and x.dtype == torch.bfloat16 and weight.dtype == torch.bfloat16
            and weight.is_contiguous() and SWITCH.usable())


def linear(x: torch.Tensor, weight: torch.Tensor,
           bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) for x [T, in], in the kernel where it pays."""
    if not runs_in_kernel(x, weight):
        return F.linear(x, weight, bias)
    out = torch.ops.stallfree.skinny_linear(x, weight)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """nn.Linear (same parameters and checkpoint names) calling `linear`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)
