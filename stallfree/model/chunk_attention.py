"""Attention of a prefill chunk that follows a cached prefix, as two flash-attention calls
merged by their log-sum-exp (CPU).

The reference (attention.py) runs one SDPA call over the whole context with an explicit
bottom-right causal mask. A mask makes torch's CPU flash kernel visit every query-key
block, masked or not, and read the mask too. Split instead: every query sees every cached
key (no mask; each KV head's query group folded into the length axis, so GQA needs no K/V
copy), and the chunk's own keys causally (`is_causal`, whose masked blocks the kernel
skips). Each part's output is normalised within its part; weighting each by the
exponential of its log-sum-exp gives the softmax over both, in fp32.
STALLFREE_SPLIT_PREFIX_ATTENTION=0 keeps the reference path.
"""
from __future__ import annotations

import torch

from .kernels import KernelSwitch

SWITCH = KernelSwitch("STALLFREE_SPLIT_PREFIX_ATTENTION", needs_library=False)


def usable(device: torch.device) -> bool:
    return device.type == "cpu" and SWITCH.enabled


def chunk_after_prefix(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       k_prefix: torch.Tensor, v_prefix: torch.Tensor,
                       scale: float) -> torch.Tensor:
    """q [L, Hq, D] and the chunk's own k, v [L, Hkv, D] (query i sits at prefix + i);
    k_prefix, v_prefix [P, Hkv, D], P >= 1, in q's dtype. Returns [L, Hq, D]."""
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    length, heads, dim = q.shape
    kv_heads = k.shape[1]
    group = heads // kv_heads
    folded = q.reshape(length, kv_heads, group, dim).permute(1, 2, 0, 3)
    out_prefix, lse_prefix = flash(folded.reshape(1, kv_heads, group * length, dim),
                                   k_prefix.transpose(0, 1).unsqueeze(0),
                                   v_prefix.transpose(0, 1).unsqueeze(0), scale=scale)
    out_prefix = out_prefix.reshape(heads, length, dim)
    lse_prefix = lse_prefix.reshape(heads, length)
    # The chunk's own keys are few: expanding them to the query heads costs little.
    out_own, lse_own = flash(q.transpose(0, 1).unsqueeze(0),
                             k.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0),
                             v.transpose(0, 1).repeat_interleave(group, 0).unsqueeze(0),
                             is_causal=True, scale=scale)
    top = torch.maximum(lse_prefix, lse_own[0])
    w_prefix = (lse_prefix - top).exp_().unsqueeze(-1)
    w_own = (lse_own[0] - top).exp_().unsqueeze(-1)
    merged = (out_prefix.float() * w_prefix).add_(out_own[0].float() * w_own)
    merged.div_(w_prefix + w_own)
    return merged.to(q.dtype).transpose(0, 1)
