"""float32 matmuls in the CPU kernel of csrc/f32_linear.cpp (linear.py's "f32" packings)
against the float64 product, and the layers' choice of it.

The kernel sums in float32 in k order, so it is held to the float64 product within the
standard bound of a float32 sum of `cols` products; the fused SiLU x up epilogue is held to
torch's SiLU and product of the same sums. Without a built kernel library (no compiler)
the tests skip, saying why.
"""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.linear import (
    GatedLinear,
    Linear,
    gated_linear,
    linear,
    pack_weight,
    silu_mul,
)
from test_linear_kernel import _rows_of_calls

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
F32_UNIT = 2.0 ** -24


def _within_the_sum_bound(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> bool:
    exact = x.double() @ w.double().t()
    cols = x.shape[1]
    bound = 1.01 * (cols + 1) * F32_UNIT * (x.double().abs() @ w.double().abs().t())
    return bool(((out.double() - exact).abs() <= bound + 1e-30).all())


@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 150), col_blocks=st.integers(1, 7), cols=st.integers(1, 300),
       seed=st.integers(0, 2**16))
def test_kernel_matches_the_float64_product(tokens, col_blocks, cols, seed):
    # Odd column blocks (a pair's single tail), partial micro-blocks of rows, any K.
    gen = torch.Generator().manual_seed(seed)
    rows = 16 * col_blocks
    x = torch.randn(tokens, cols, generator=gen)
    w = torch.randn(rows, cols, generator=gen)
    out = torch.ops.stallfree.f32_linear(x, torch.ops.stallfree.f32_pack(w), rows)
    assert out.dtype == torch.float32 and out.shape == (tokens, rows)
    assert _within_the_sum_bound(out, x, w)


def test_the_model_shapes_many_rows_and_strided_x():
    """The default model's shapes at a decode step's and a prefill chunk's rows; 300 rows of
    K = 1536 span several of the kernel's chunks of rows held in L2."""
    torch.manual_seed(0)
    for n, k in ((960, 576), (576, 1536), (49152, 576)):
        w = torch.randn(n, k) * 0.05
        packed = pack_weight(w)
        assert packed is not None and packed.layout == "f32" and packed.nbytes == w.nbytes
        for tokens in (1, 13, 300):
            if n == 49152 and tokens == 300:
                continue  # the logits are computed for sampled rows only
            x = torch.randn(tokens, 2 * k)[:, ::2]  # not contiguous
            assert _within_the_sum_bound(linear(x, w, packed=packed), x, w)


@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 40), half_blocks=st.integers(1, 4), cols=st.integers(1, 100),
       scale=st.sampled_from([0.1, 1.0, 30.0]), seed=st.integers(0, 2**16))
def test_silu_mul_in_the_epilogue_equals_the_unfused_ops(tokens, half_blocks, cols, scale,
                                                         seed):
    """The fused gate/up matmul against the same sums stored, then torch's SiLU and product:
    the sums are the same bits, and the two exponentials differ by an ulp or two. Large
    gates (scale 30) reach where e^-x overflows float32."""
    gen = torch.Generator().manual_seed(seed)
    inter = 16 * half_blocks  # odd block counts per half too
    x = torch.randn(tokens, cols, generator=gen) * scale
    w = torch.randn(2 * inter, cols, generator=gen)
    packed = pack_weight(w, gated=True)
    assert packed.layout == "f32_gated"
    fused = gated_linear(x, w, packed)
    unfused = silu_mul(torch.ops.stallfree.f32_linear(x, pack_weight(w).data, 2 * inter))
    assert fused.shape == (tokens, inter) and fused.dtype == torch.float32
    torch.testing.assert_close(fused, unfused, rtol=2e-6, atol=1e-30)


def test_layers_take_the_kernel_at_any_rows_unless_switched_off(monkeypatch):
    plain = _rows_of_calls(monkeypatch, "f32_linear")
    gated = _rows_of_calls(monkeypatch, "f32_linear_silu_mul")
    layer, mlp = Linear(64, 48, bias=True), GatedLinear(64, 2 * 64, bias=False)
    weights = layer.weight.clone(), mlp.weight.clone()
    layer.prepack()
    mlp.prepack()
    assert (layer.packed.layout, mlp.packed.layout) == ("f32", "f32_gated")
    for tokens in (1, 600):
        x = torch.randn(tokens, 64)
        torch.testing.assert_close(layer(x), F.linear(x, weights[0], layer.bias))
        torch.testing.assert_close(mlp(x), silu_mul(F.linear(x, weights[1])))
    assert plain == [1, 600] and gated == [1, 600]
    no_kernel = choose_kernels({"matmul_f32": "torch"})
    x = torch.randn(3, 64)  # torch's path, on the plain weights read back from the packing
    torch.testing.assert_close(linear(x, layer.weight, layer.bias, layer.packed, no_kernel),
                               F.linear(x, weights[0], layer.bias))
    torch.testing.assert_close(gated_linear(x, mlp.weight, mlp.packed, no_kernel),
                               silu_mul(F.linear(x, weights[1])))
    assert plain == [1, 600] and gated == [1, 600]


def test_shapes_the_packing_cannot_take_keep_torchs_layout_or_stay_unfused():
    assert pack_weight(torch.randn(40, 64)) is None  # rows not in blocks of 16
    assert pack_weight(torch.randn(64, 64), kernels=choose_kernels({"matmul_f32": "torch"})) \
        is None
    # Halves of 24 rows cannot interleave in blocks: the plain packing, SiLU x up after it.
    odd = GatedLinear(64, 48, bias=False)
    weight = odd.weight.clone()
    odd.prepack()
    assert odd.packed.layout == "f32"
    x = torch.randn(5, 64)
    assert torch.equal(odd(x), silu_mul(linear(x, weight, packed=odd.packed)))
    torch.testing.assert_close(odd(x), silu_mul(F.linear(x, weight)))


def test_bad_operands_are_refused():
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.stallfree.f32_pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="float32 weight"):
        torch.ops.stallfree.f32_pack(torch.randn(16, 32).bfloat16())
    packed = torch.ops.stallfree.f32_pack(torch.randn(16, 32))
    with pytest.raises(RuntimeError, match="does not fit"):
        torch.ops.stallfree.f32_linear(torch.randn(2, 64), packed, 16)
    with pytest.raises(RuntimeError, match="float32 x"):
        torch.ops.stallfree.f32_linear(torch.randn(2, 32).bfloat16(), packed, 16)
    with pytest.raises(RuntimeError, match="multiple of 32"):
        torch.ops.stallfree.f32_linear_silu_mul(torch.randn(2, 32), packed, 16)


def test_an_empty_inner_dimension_gives_zeros_as_torch_does():
    w = torch.randn(16, 0)
    out = torch.ops.stallfree.f32_linear(torch.randn(3, 0), torch.ops.stallfree.f32_pack(w), 16)
    assert torch.equal(out, F.linear(torch.randn(3, 0), w))
