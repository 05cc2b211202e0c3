"""The sparse mixture-of-experts MLP of Mixtral and Qwen3-MoE: a router picks top_k of
num_experts SwiGLU experts per token, and the token's output is their weighted sum.

Routing follows transformers 5 (MixtralTopKRouter, Qwen3MoeTopKRouter) op for op, so that
the same experts win, ties included: logits in the input dtype, softmax in float32,
torch.topk, then (renormalize) the top-k weights divided by their sum.

The experts run grouped: the (token, expert) pairs are sorted by expert, and each expert
that received tokens runs one gate/up matmul over all of them, the activation, and one
down matmul. A decode step (1-8 tokens) thus reads only its active experts' weights, and
no Python loop runs over tokens. An expert's rows come in transformers' order and each
expert's scaled output is added in ascending expert order, as transformers does, so float32
results are bit for bit its own. Each add is one index_add_ (on CPU, small ones serial: see
_SERIAL_ADD_ELEMENTS); a token meets an expert at most once, so there is no race on CUDA and
the sum is in the same order on every device.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from .linear import GatedLinear, Linear

__all__ = ["ACTIVATIONS", "SparseMoE"]

# ATen's grain size: below it an op is not worth a parallel region. index_add_ on CPU (dim 0,
# alpha 1) runs as a scatter_add_ that opens one whatever the size, and where the second
# core is busy its barrier waits out the other thread's time slice: measured on a 2-core
# EPYC with a test run beside it, a 1-token forward at H 1024 took 53-55 ms in medians,
# 3.9 ms with the small adds done serially (index_put_ with accumulate: the same one add
# per element, so the same bits).
_SERIAL_ADD_ELEMENTS = 32768


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


# transformers' name for the tanh GELU is "gelu_pytorch_tanh": accepted too, so that a
# config's hidden_act can be passed as is.
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu, "gelu_tanh": _gelu_tanh, "gelu_pytorch_tanh": _gelu_tanh}


class _Router(nn.Module):
    """Holds only `weight` [num_experts, hidden], so the checkpoint name is router.weight."""

    def __init__(self, num_experts: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size))


class SparseMoE(nn.Module):
    """x [T, H] -> [T, H], the same dtype.

    Parameters (plain 2-D, so the loader fills them by rows; uninitialised until it does):
      router.weight    [E, H]
      experts_gate_up  [E * 2I, H]: expert e's gate rows [e*2I, e*2I + I), up rows
                       [e*2I + I, (e+1)*2I)
      experts_down     [E * H, I]: expert e's down_proj rows [e*H, (e+1)*H)
    """

    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int,
                 top_k: int, renormalize: bool, activation: str = "silu") -> None:
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unsupported MoE activation {activation!r}; "
                             f"expected one of {sorted(ACTIVATIONS)}")
        if not 0 < top_k <= num_experts:
            raise ValueError(f"top_k {top_k} must be in [1, num_experts={num_experts}]")
        self.hidden_size = hidden_size
        self.intermediate_size = intermediate_size
        self.num_experts = num_experts
        self.top_k = top_k
        self.renormalize = renormalize
        self.activation = activation
        self.act = ACTIVATIONS[activation]
        # torch.empty, not an init: the loader overwrites every row, and on the meta device
        # (the loader's) there is nothing to compute.
        self.router = _Router(num_experts, hidden_size)
        self.experts_gate_up = nn.Parameter(
            torch.empty(num_experts * 2 * intermediate_size, hidden_size))
        self.experts_down = nn.Parameter(
            torch.empty(num_experts * hidden_size, intermediate_size))
        # Each expert's (gate/up, down) as the engine's Linears, once split_experts ran; the
        # stacked parameters are gone then. (An instance attribute: a class one would hide
        # the registered module from nn.Module's lookup.)
        self.experts: nn.ModuleList | None = None

    def split_experts(self) -> None:
        """Each expert's rows as Linears of their own (gate/up a GatedLinear for SiLU), which
        the model's prepack then packs for its kernels, the stacked parameters dropped: on
        row slices of them, F.linear ran a batch-1 decode step at 1.73x a dense model of
        the same active size, and 5.5x at batch 8 (benchmarks/moe_decode.py)."""
        if self.experts is not None:
            return
        two_i, h = 2 * self.intermediate_size, self.hidden_size
        gated = GatedLinear if self.activation == "silu" else Linear
        experts = []
        for e in range(self.num_experts):
            gate_up = gated(h, two_i, bias=False)
            down = Linear(self.intermediate_size, h, bias=False)
            for module, rows in ((gate_up, self.experts_gate_up[e * two_i:(e + 1) * two_i]),
                                 (down, self.experts_down[e * h:(e + 1) * h])):
                module.weight = nn.Parameter(rows.clone(), requires_grad=False)
            experts.append(nn.ModuleList([gate_up, down]))
        self.experts = nn.ModuleList(experts)
        self.experts_gate_up = self.experts_down = None

    def _expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Expert e's MLP over its tokens' rows x."""
        if self.experts is not None:
            gate_up, down = self.experts[e]
            h = gate_up(x)  # a GatedLinear applies SiLU x up itself
            if not gate_up.gated:
                gate, up = h.chunk(2, dim=-1)
                h = self.act(gate) * up
            return down(h)
        two_i, h = 2 * self.intermediate_size, self.hidden_size
        # Row slices of the 2-D parameters: contiguous views, no copy.
        gate, up = F.linear(x, self.experts_gate_up[e * two_i:(e + 1) * two_i]).chunk(2, dim=-1)
        return F.linear(self.act(gate) * up, self.experts_down[e * h:(e + 1) * h])

    def extra_repr(self) -> str:
        return (f"hidden={self.hidden_size}, intermediate={self.intermediate_size}, "
                f"experts={self.num_experts}, top_k={self.top_k}, "
                f"renormalize={self.renormalize}, activation={self.activation}")

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, top_k] float32, experts [T, top_k] int64), as transformers' router
        computes them (its ops in its order, so torch.topk breaks ties the same way)."""
        logits = F.linear(x, self.router.weight)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        # Kept in float32: each expert's output is scaled in float32 and rounded once to
        # x's dtype, as transformers' Mixtral does (Qwen3-MoE rounds the weights to x's
        # dtype first; the two agree in float32 and differ by a bf16 rounding in bf16).
        return weights, experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"SparseMoE takes x [T, {self.hidden_size}], got {tuple(x.shape)}")
        weights, experts = self.route(x)
        # Pairs numbered slot-major (p = slot * T + token) and stably sorted by expert: an
        # expert's rows then come in transformers' order (its torch.where over a [top_k, T]
        # mask), so each matmul sees the same rows in the same order and rounds alike.
        flat = experts.t().reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = order % x.shape[0]
        pair_weights = weights.t().reshape(-1)[order].unsqueeze(1)
        # The one host sync: which experts are active, and where their pairs lie.
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        grouped = x.index_select(0, tokens)  # x's rows in expert order, one gather
        out = torch.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            rows = slice(start, start + n)
            start += n
            y = self._expert(e, grouped[rows])
            _accumulate(out, tokens[rows], (y * pair_weights[rows]).to(x.dtype))
        return out


def _accumulate(out: torch.Tensor, index: torch.Tensor, src: torch.Tensor) -> None:
    """out[index] += src for distinct indices (a token meets an expert at most once)."""
    if out.device.type == "cpu" and src.numel() <= _SERIAL_ADD_ELEMENTS:
        out.index_put_((index,), src, accumulate=True)
    else:
        out.index_add_(0, index, src)
