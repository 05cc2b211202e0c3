"""Building blocks shared by Llama-family decoders: RMSNorm, rotary embeddings, SwiGLU MLP."""
from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from . import kv_quant
from .kernel_table import Choice, KernelTable, ensure
from .linear import GatedLinear, Linear

# The CPU kernels of csrc/fused_ops.cpp (residual add + RMSNorm in one pass) and
# csrc/rope_cache.cpp, for what the torch paths below do in 6-10 small ops (whose dispatch,
# not arithmetic, is a decode step's cost there): the kernel table's norm and rope_cache.


def _fused(x: torch.Tensor, choice: Choice) -> bool:
    return (choice.kernel and x.device.type == "cpu" and x.dim() == 2 and x.is_contiguous()
            and x.dtype in (torch.float32, torch.bfloat16))


def cache_fits_rope(kv_cache: torch.Tensor, dtype: torch.dtype) -> bool:
    """Whether rope_and_cache's kernel can write a qkv of `dtype` into this cache: one of
    its dtype, or an int8 one (whose rows it quantizes as kv_quant.quantize does)."""
    return ((kv_cache.dtype == dtype or kv_quant.is_quantized(kv_cache.dtype))
            and kv_cache.is_contiguous() and kv_quant.head_dim(kv_cache) % 32 == 0)


def rope_and_cache(qkv: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor,
                   kv_cache: torch.Tensor, slot_mapping: torch.Tensor, heads: int,
                   kv_heads: int, kernels: KernelTable | None = None) -> bool:
    """RoPE on the q and k heads of qkv [T, (heads + 2 kv_heads) D] in place and the k and
    v heads written to their cache slots (quantized into an int8 cache), in the kernel of
    csrc/rope_cache.cpp (one pass for what apply_rope and kv_quant.write do in six ops or
    more); False, with nothing done, where it does not apply: the caller then takes the
    torch path."""
    t = qkv.shape[0]
    if not (_fused(qkv, ensure(kernels).rope_cache) and cache_fits_rope(kv_cache, qkv.dtype)
            and cos.dtype == qkv.dtype):
        return False
    torch.ops.stallfree.rope_cache(qkv, cos.reshape(t, -1), signed_sin.reshape(t, -1),
                                   kv_cache, slot_mapping, heads, kv_heads)
    return True


class RMSNorm(nn.Module):
    # The model's table (None: `default_kernels`); set at load (CausalLM.prepack).
    kernels: KernelTable | None = None

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _fused(x, ensure(self.kernels).norm):
            return torch.ops.stallfree.rms_norm(x, self.weight, self.eps)
        # Normalise in fp32 like the reference, so bf16 runs do not lose precision in
        # the variance; the weight multiply happens in the input dtype.
        dtype = x.dtype
        normed = F.rms_norm(x.float(), (x.shape[-1],), eps=self.eps)
        return self.weight * normed.to(dtype)

    def add_forward(self, x: torch.Tensor,
                    residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(x + residual), x + residual), the sum rounded to the dtype as a plain add
        is; `residual` may be overwritten with the sum."""
        if _fused(x, ensure(self.kernels).norm) and residual.is_contiguous():
            return torch.ops.stallfree.add_rms_norm(x, residual, self.weight, self.eps), residual
        total = x + residual
        return self(total), total


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim // 2] in fp32, with the configured scaling applied."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    if scaling is None:
        return inv_freq
    kind = scaling["rope_type"]
    if kind == "linear":
        # Stretching positions by `factor` is the same as shrinking every frequency.
        return inv_freq / float(scaling["factor"])
    if kind == "freq_factors":
        factors = torch.tensor(scaling["factors"], dtype=torch.float32)
        if factors.numel() != inv_freq.numel():
            raise ValueError(f"rope freq_factors has {factors.numel()} entries, "
                             f"expected {inv_freq.numel()}")
        return inv_freq / factors
    if kind == "llama3":
        return _llama3_inv_freq(inv_freq, scaling)
    raise ValueError(f"unsupported rope_scaling type {kind!r}")


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1 scaling: long wavelengths (beyond the original context / low_freq_factor)
    # are slowed by `factor`, short ones (below context / high_freq_factor) are kept, and
    # the band in between is interpolated linearly in 1/wavelength.
    factor = float(scaling["factor"])
    low = float(scaling.get("low_freq_factor", 1.0))
    high = float(scaling.get("high_freq_factor", 4.0))
    orig_ctx = float(scaling["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    slowed = inv_freq / factor
    smooth = ((orig_ctx / wavelen - low) / (high - low)).clamp(0.0, 1.0)
    blended = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    out = torch.where(wavelen > orig_ctx / low, slowed, blended)
    return torch.where(wavelen < orig_ctx / high, inv_freq, out)


class RotaryEmbedding(nn.Module):
    """RoPE in the HF "rotate_half" layout: dims [0, d/2) pair with [d/2, d)."""

    def __init__(self, head_dim: int, max_positions: int, theta: float,
                 scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.max_positions = max_positions
        self.theta = theta
        self.scaling = scaling
        # Non-persistent: derived from the config, never stored in checkpoints. Built on the
        # meta device (the loader's), it is only shaped here and computed by reset_table
        # once the model has storage: the first arithmetic on meta tensors costs ~0.5-1 s of
        # start-up in torch's lazy imports.
        table = (torch.empty(2, max_positions, head_dim) if torch.empty(0).is_meta
                 else self._table())
        self.register_buffer("cos_sin", table, persistent=False)

    def _table(self, device: torch.device | None = None) -> torch.Tensor:
        inv_freq = rope_inv_freq(self.head_dim, self.theta, self.scaling).to(device)
        t = torch.arange(self.max_positions, dtype=torch.float32, device=device)
        freqs = torch.outer(t, inv_freq)
        cos, sin = freqs.cos(), freqs.sin()
        # sin carries rotate_half's sign (-sin on the first half), see apply_rope.
        return torch.stack((torch.cat((cos, cos), -1), torch.cat((-sin, sin), -1)))

    def reset_table(self) -> None:
        """Recompute the table in place (needed after `nn.Module.to_empty`)."""
        buf = self.cos_sin
        self.cos_sin = self._table(buf.device).to(buf.dtype)

    def lookup(self, positions: torch.Tensor,
               dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, signed sin for each position, [T, 1, head_dim]; once per forward, shared by
        layers."""
        cs = self.cos_sin[:, positions].to(dtype)
        return cs[0].unsqueeze(1), cs[1].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x: [T, heads, head_dim]; cos/signed_sin: [T, 1, head_dim] from `RotaryEmbedding.lookup`.

    Equals HF's x * cos + rotate_half(x) * sin: swapping the halves is a flip over a
    [2, head_dim / 2] view, and rotate_half's negation is folded into the table.
    """
    t, h, d = x.shape
    swapped = x.view(t, h, 2, d // 2).flip(2).view(t, h, d)
    return x * cos + swapped * signed_sin


class SwiGLUMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        # gate and up fused into one matmul (rows [0, I) gate, [I, 2I) up) that returns
        # silu(gate) * up.
        self.gate_up_proj = GatedLinear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))
