"""The fused CPU op of csrc/fused_ops.cpp (residual add + RMSNorm) against the torch path
of layers.py, which stays the reference. Without a built kernel library the
tests that run them skip, saying why."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.layers import RMSNorm, RotaryEmbedding, apply_rope, rope_and_cache

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
# The sum of squares may round in another order than torch's: float32 differs in
# the last bits; bf16 by one ulp of the normed value before the weight multiplies it and
# the product is rounded again (2 ulps, 2^-6 relative).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -6, atol=1e-3)}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _both(norm: RMSNorm, fn):
    """fn() with the fused kernel and with the torch path (the norm's table says which)."""
    fused = fn()
    norm.kernels = choose_kernels({"norm": "torch"})
    try:
        reference = fn()
    finally:
        norm.kernels = None
    return fused, reference


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(rows=st.integers(1, 40), dim=st.integers(1, 300), dtype=DTYPES, seed=st.integers(0, 999))
def test_add_rms_norm_matches_the_torch_path(rows, dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    norm = RMSNorm(dim, 1e-5).to(dtype)
    norm.weight.data = torch.randn(dim, generator=gen).to(dtype)
    x = torch.randn(rows, dim, generator=gen).to(dtype)
    residual = (3 * torch.randn(rows, dim, generator=gen)).to(dtype)
    (out, total), (ref_out, ref_total) = _both(norm, lambda: norm.add_forward(x, residual.clone()))
    assert torch.equal(total, ref_total)  # the residual stream is rounded as a plain add
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    plain, ref_plain = _both(norm, lambda: norm(x))
    torch.testing.assert_close(plain, ref_plain, **TOL[dtype])


@needs_kernel
def test_only_contiguous_cpu_float32_and_bf16_rows_are_fused():
    norm = RMSNorm(16, 1e-6)
    x = torch.randn(4, 32)[:, ::2]  # strided: the torch path
    torch.testing.assert_close(norm(x), norm(x.contiguous()), rtol=1e-5, atol=1e-6)
    half = torch.randn(3, 16).half()
    assert norm.half()(half).dtype == torch.float16  # float16 stays on the torch path


@needs_kernel
def test_bad_operands_are_refused():
    x = torch.randn(2, 8)
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.stallfree.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(RuntimeError, match="residual"):
        torch.ops.stallfree.add_rms_norm(x, torch.zeros(2, 9), torch.ones(8), 1e-6)


@needs_kernel
@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 40), kv_heads=st.integers(1, 3), group=st.integers(1, 3),
       head_dim=st.sampled_from([32, 64, 128]), dtype=DTYPES, seed=st.integers(0, 999))
def test_rope_and_cache_matches_the_torch_path(tokens, kv_heads, group, head_dim, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    heads, block_size, num_blocks = kv_heads * group, 4, 16
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None).to(dtype)
    positions = torch.randint(0, 256, (tokens,), generator=gen)
    cos, sin = rotary.lookup(positions, dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
    cache = torch.zeros(2, num_blocks, block_size, kv_heads, head_dim, dtype=dtype)

    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    assert rope_and_cache(fused_qkv, cos, sin, fused_cache, slots, heads, kv_heads)

    qk = qkv[:, :(heads + kv_heads) * head_dim].view(tokens, heads + kv_heads, head_dim)
    rotated = apply_rope(qk, cos, sin)
    v = qkv[:, (heads + kv_heads) * head_dim:].view(tokens, kv_heads, head_dim)
    ref_cache = cache.clone()
    ref_cache[0].view(-1, kv_heads, head_dim).index_copy_(0, slots, rotated[:, heads:])
    ref_cache[1].view(-1, kv_heads, head_dim).index_copy_(0, slots, v)
    got = fused_qkv[:, :(heads + kv_heads) * head_dim].view_as(rotated)
    if dtype == torch.bfloat16:  # every product and sum rounds where the reference's does
        assert torch.equal(got, rotated) and torch.equal(fused_cache, ref_cache)
    else:  # the compiler may fuse a product into the sum (one rounding fewer)
        torch.testing.assert_close(got, rotated, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(fused_cache, ref_cache, rtol=1e-6, atol=1e-6)
    v_from = (heads + kv_heads) * head_dim
    assert torch.equal(fused_qkv[:, v_from:], qkv[:, v_from:])  # v is left as it was


@needs_kernel
def test_rope_and_cache_declines_what_it_does_not_cover_and_refuses_bad_slots():
    rotary = RotaryEmbedding(16, 32, 10000.0, None)
    cos, sin = rotary.lookup(torch.arange(2), torch.float32)
    cache = torch.zeros(2, 4, 4, 1, 16)
    qkv = torch.randn(2, 3 * 16)
    # head_dim 16 (not a multiple of 32): the torch path, nothing written.
    assert not rope_and_cache(qkv.clone(), cos, sin, cache, torch.tensor([0, 1]), 1, 1)
    assert not cache.any()
    rotary = RotaryEmbedding(32, 32, 10000.0, None)
    cos, sin = rotary.lookup(torch.arange(2), torch.float32)
    cache = torch.zeros(2, 4, 4, 1, 32)
    with pytest.raises(RuntimeError, match="outside the cache"):
        rope_and_cache(torch.randn(2, 96), cos, sin, cache, torch.tensor([0, 16]), 1, 1)
    assert not cache.any()
    # A table with rope_cache on torch: the torch path, nothing written.
    assert not rope_and_cache(torch.randn(2, 96), cos, sin, cache, torch.tensor([0, 1]), 1, 1,
                              choose_kernels({"rope_cache": "torch"}))
    assert not cache.any()
