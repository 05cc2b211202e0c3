"""The fused CPU op of csrc/fused_ops.cpp (residual add + RMSNorm) against the torch path
of layers.py, which stays the reference. Without a built kernel library the
tests that run them skip, saying why."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.kernels import unavailable_reason
from stallfree.model.layers import FUSED, RMSNorm

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
# The sum of squares may round in another order than torch's: float32 differs in
# the last bits; bf16 by one ulp of the normed value before the weight multiplies it and
# the product is rounded again (2 ulps, 2^-6 relative).
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-6), torch.bfloat16: dict(rtol=2 ** -6, atol=1e-3)}
DTYPES = st.sampled_from([torch.float32, torch.bfloat16])


def _both(fn):
    """fn() with the fused kernels and with the torch path."""
    fused = fn()
    with FUSED.within(False):
        reference = fn()
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
    (out, total), (ref_out, ref_total) = _both(lambda: norm.add_forward(x, residual.clone()))
    assert torch.equal(total, ref_total)  # the residual stream is rounded as a plain add
    torch.testing.assert_close(out, ref_out, **TOL[dtype])
    plain, ref_plain = _both(lambda: norm(x))
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
