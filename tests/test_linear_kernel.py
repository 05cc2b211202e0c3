"""Few-token bf16 matmuls in the CPU kernel (stallfree/model/linear.py) against torch.

The kernel accumulates in fp32 in another order than torch's bf16 matmul, so both are held
to the float64 product with bf16's rounding as the bound. Without a built kernel library
(no compiler) the tests that run it skip, saying why.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.kernels import unavailable_reason
from stallfree.model.linear import PACKED, SKINNY_MAX_TOKENS, SWITCH, Linear, linear, pack_weight

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
BF16_EPS = 2.0 ** -8  # half a bf16 ulp, relative: the output's own rounding


def _bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """Per-output error bound: the output's rounding plus fp32 accumulation slack."""
    mag = x.double().abs() @ w.double().abs().t()
    return 2 * BF16_EPS * mag + 1e-30


@needs_kernel
@settings(max_examples=60, deadline=None)
@given(tokens=st.integers(1, SKINNY_MAX_TOKENS), rows=st.integers(1, 70),
       cols=st.integers(1, 200), seed=st.integers(0, 2**16))
def test_kernel_matches_the_float64_product_within_bf16_rounding(tokens, rows, cols, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, cols, generator=gen).bfloat16()
    w = torch.randn(rows, cols, generator=gen).bfloat16()
    out = torch.ops.stallfree.skinny_linear(x, w)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, rows)
    exact = x.double() @ w.double().t()
    assert ((out.double() - exact).abs() <= _bound(x, w)).all()
    # torch's own bf16 matmul meets the same bound: the kernel is no less exact.
    assert ((F.linear(x, w).double() - exact).abs() <= _bound(x, w)).all()


@needs_kernel
def test_the_model_shapes_match_torch():
    torch.manual_seed(0)
    for rows, cols in ((960, 576), (3072, 576), (576, 1536), (49152, 576)):
        w = torch.randn(rows, cols).bfloat16()
        x = torch.randn(3, cols).bfloat16()
        out = linear(x, w).double()
        exact = x.double() @ w.double().t()
        assert ((out - exact).abs() <= _bound(x, w)).all()


@needs_kernel
def test_linear_takes_the_kernel_only_for_few_bf16_rows(monkeypatch):
    calls = []
    real = torch.ops.stallfree.skinny_linear
    monkeypatch.setattr(torch.ops.stallfree, "skinny_linear",
                        lambda x, w: calls.append(x.shape) or real(x, w))
    layer = Linear(64, 48, bias=True).bfloat16()
    x = torch.randn(SKINNY_MAX_TOKENS + 1, 64).bfloat16()
    expected = F.linear(x, layer.weight, layer.bias)
    layer(x)                                   # too many rows: torch
    layer.float()(x.float())                   # float32: torch
    with SWITCH.within(False):
        layer.bfloat16()(x[:1])                # switched off: torch
    assert calls == []
    got = layer(x[:2])
    assert len(calls) == 1
    bound = _bound(x[:2], layer.weight) + 2 * BF16_EPS * layer.bias.double().abs()
    assert ((got.double() - expected[:2].double()).abs() <= 2 * bound).all()


@needs_kernel
def test_bad_operands_are_refused():
    x = torch.randn(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match="bfloat16"):
        torch.ops.stallfree.skinny_linear(x.float(), torch.randn(8, 16))
    with pytest.raises(RuntimeError, match="weight"):
        torch.ops.stallfree.skinny_linear(x, torch.randn(8, 15).bfloat16())
    with pytest.raises(RuntimeError, match="row-major"):
        torch.ops.stallfree.skinny_linear(x, torch.randn(16, 8).bfloat16().t())



needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(),
                                  reason="this torch build has no oneDNN (mkldnn)")


@needs_onednn
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(SKINNY_MAX_TOKENS + 1, 600), rows=st.integers(1, 70),
       cols=st.integers(1, 200), bias=st.booleans(), seed=st.integers(0, 2**16))
def test_prepacked_weights_match_the_float64_product_within_bf16_rounding(
        tokens, rows, cols, bias, seed):
    gen = torch.Generator().manual_seed(seed)
    layer = Linear(cols, rows, bias=bias).bfloat16()
    with torch.no_grad():
        layer.weight.copy_(torch.randn(rows, cols, generator=gen))
    layer.prepack()
    assert layer.packed is not None
    x = torch.randn(tokens, cols, generator=gen).bfloat16()
    out = layer(x).double()
    exact = x.double() @ layer.weight.double().t()
    bound = _bound(x, layer.weight)
    if bias:
        exact += layer.bias.double()
        bound = 2 * bound + 2 * BF16_EPS * layer.bias.double().abs()
    assert out.shape == (tokens, rows)
    assert ((out - exact).abs() <= bound).all()


@needs_onednn
def test_packed_weights_are_used_only_where_they_apply(monkeypatch):
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise",
                        lambda *a: calls.append(a[0].shape) or real(*a))
    layer = Linear(64, 48, bias=False).bfloat16()
    layer.prepack()
    x = torch.randn(SKINNY_MAX_TOKENS + 3, 64).bfloat16()
    with PACKED.within(False):
        reference = layer(x)                   # switched off: F.linear
    assert calls == []
    got = layer(x)
    assert calls == [x.shape]
    bound = 2 * _bound(x, layer.weight)  # two roundings of the same product
    assert ((got.double() - reference.double()).abs() <= bound).all()
    assert layer.float()(x.float()).dtype == torch.float32  # the bf16 pack is not used
    assert len(calls) == 1
    assert pack_weight(torch.randn(8, 8)) is None  # float32 weights keep torch's layout


@needs_onednn
def test_loading_in_bf16_packs_every_matmul_weight_and_float32_packs_none(tiny_model):
    from stallfree.model import load_model

    for dtype, packed in ((torch.bfloat16, True), (torch.float32, False)):
        model, config = load_model(tiny_model, dtype, "cpu")
        layers = [m for m in model.modules() if isinstance(m, Linear)]
        assert layers and all((m.packed is not None) == packed for m in layers)
        if config.tie_word_embeddings:
            assert (model.logits_packed is not None) == packed
