"""bf16 matmuls in the CPU kernels (stallfree/model/linear.py: the tile packing's kernel in
AMX tiles or AVX512_BF16 vectors, few-row vectors) and from prepacked weights, against
torch.

The kernels accumulate in fp32 in another order than torch's bf16 matmul, so both are held
to the float64 product with bf16's rounding as the bound. Without a built kernel library
(no compiler) the tests that run it skip, saying why; the tile packing's tests say which
CPU flag or permission is missing. They run the kernel in tiles and in vectors (on a CPU
without AMX, both are the vectors).
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import amx_unavailable_reason, unavailable_reason
from stallfree.model.linear import (
    AMX_MAX_ROWS,
    SKINNY_MAX_TOKENS,
    GatedLinear,
    Linear,
    gated_linear,
    linear,
    onednn_bf16_unavailable_reason,
    pack_weight,
    pair_kernel_max_rows,
    pair_kernel_unavailable_reason,
    silu_mul,
)

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")


AMX_MISSING = amx_unavailable_reason()
PAIRS_MISSING = pair_kernel_unavailable_reason()
needs_pairs = pytest.mark.skipif(PAIRS_MISSING is not None,
                                 reason=f"tile packing's kernel: {PAIRS_MISSING}")
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
    layer.bfloat16()
    no_skinny = choose_kernels({"matmul_bf16_few_rows": "torch"})
    linear(x[:1], layer.weight, layer.bias, kernels=no_skinny)  # the table says torch
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



ONEDNN_BF16 = onednn_bf16_unavailable_reason()
needs_onednn = pytest.mark.skipif(ONEDNN_BF16 is not None, reason=f"no bf16 prepack: {ONEDNN_BF16}")


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
    layer.prepack(choose_kernels({"matmul_bf16": "onednn"}))
    assert layer.packed is not None and layer.packed.layout == "onednn"
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
    layer.prepack(choose_kernels({"matmul_bf16": "onednn"}))
    x = torch.randn(SKINNY_MAX_TOKENS + 3, 64).bfloat16()
    reference = linear(x, layer.weight, layer.bias, layer.packed,  # the table says F.linear
                       choose_kernels({"matmul_bf16": "torch"}))
    assert calls == []
    got = layer(x)
    assert calls == [x.shape]
    bound = 2 * _bound(x, layer.weight)  # two roundings of the same product
    assert ((got.double() - reference.double()).abs() <= bound).all()
    assert layer.float()(x.float()).dtype == torch.float32  # the bf16 pack is not used
    assert len(calls) == 1
    assert pack_weight(torch.randn(8, 8).half()) is None  # float16 weights keep torch's layout


def test_loading_packs_every_matmul_weight_in_bf16_and_in_float32(tiny_model):
    """bf16 weights are packed where oneDNN takes bf16 (the tile packing's CPUs all do), else
    none is (AVX2-only CPUs); float32 weights take the f32 kernel's packing where the kernels
    are built, else none."""
    from stallfree.model import load_model

    for dtype in (torch.bfloat16, torch.float32):
        model, config = load_model(tiny_model, dtype, "cpu")
        packs = [m.packed for m in model.modules() if isinstance(m, Linear)]
        packs += [model.logits_packed] if config.tie_word_embeddings else []
        assert len(packs) > 1
        if dtype == torch.bfloat16:
            assert all((p is not None) == (ONEDNN_BF16 is None) for p in packs)
        elif REASON is None:
            assert all(p is not None and p.layout.startswith("f32") for p in packs)
        else:
            assert all(p is None for p in packs)


@needs_pairs
@settings(max_examples=40, deadline=None)
@given(tokens=st.integers(1, 300), col_blocks=st.integers(1, 7), k_tiles=st.integers(1, 5),
       seed=st.integers(0, 2**16), tiles=st.booleans())
def test_amx_kernel_matches_the_float64_product_within_bf16_rounding(tokens, col_blocks,
                                                                     k_tiles, seed, tiles):
    # Odd column blocks (a pair's single tail), 1 or 2 row tiles, row chunks past 256.
    gen = torch.Generator().manual_seed(seed)
    rows, cols = 16 * col_blocks, 32 * k_tiles
    x = torch.randn(tokens, cols, generator=gen).bfloat16()
    w = torch.randn(rows, cols, generator=gen).bfloat16()
    out = torch.ops.stallfree.amx_linear(x, torch.ops.stallfree.amx_pack(w), rows, tiles)
    assert out.dtype == torch.bfloat16 and out.shape == (tokens, rows)
    assert ((out.double() - x.double() @ w.double().t()).abs() <= _bound(x, w)).all()


@needs_pairs
def test_amx_runs_the_model_shapes_and_strided_rows():
    torch.manual_seed(0)
    for rows, cols in ((960, 576), (576, 1536), (49152, 576)):
        w = torch.randn(rows, cols).bfloat16()
        packed = pack_weight(w)
        assert packed is not None and packed.layout == "amx" and packed.nbytes == w.nbytes
        for tokens in (1, 32, 512):
            x = torch.randn(tokens, 2 * cols).bfloat16()[:, ::2]  # not contiguous
            out = linear(x, w, packed=packed).double()
            assert ((out - x.double() @ w.double().t()).abs() <= _bound(x, w)).all()


def _rows_of_calls(monkeypatch, op: str) -> list[int]:
    """The rows of x of every call to torch.ops.stallfree.<op> from now on, in order."""
    calls: list[int] = []
    real = getattr(torch.ops.stallfree, op)
    monkeypatch.setattr(torch.ops.stallfree, op,
                        lambda x, p, n: calls.append(x.shape[0]) or real(x, p, n))
    return calls


@needs_pairs
def test_amx_packing_is_chosen_where_the_shape_fits_and_used_up_to_its_row_limit(monkeypatch):
    calls = _rows_of_calls(monkeypatch, "amx_linear")
    layer = Linear(64, 48, bias=True).bfloat16()
    weight = layer.weight.clone()
    layer.prepack()
    assert layer.packed.layout == "amx"
    # The plain copy goes where the kernel takes every row count (vectors), not with tiles.
    assert (layer.weight is None) == (pair_kernel_max_rows() == sys.maxsize)
    sizes = (1, SKINNY_MAX_TOKENS + 1, AMX_MAX_ROWS, AMX_MAX_ROWS + 1)
    for tokens in sizes:
        x = torch.randn(tokens, 64).bfloat16()
        got = layer(x)
        bound = 2 * _bound(x, weight) + 2 * BF16_EPS * layer.bias.double().abs()
        assert ((got.double() - F.linear(x, weight, layer.bias).double()).abs()
                <= 2 * bound).all()
    # More rows than the limit (AMX tiles only; vectors have none): torch.
    assert calls == [t for t in sizes if t <= pair_kernel_max_rows()]
    assert pair_kernel_max_rows() == (AMX_MAX_ROWS if AMX_MISSING is None else sys.maxsize)
    count = len(calls)
    x = torch.randn(8, 64).bfloat16()  # torch's path, on the plain weight (kept or read back)
    assert torch.equal(linear(x, layer.weight, layer.bias, layer.packed,
                              choose_kernels({"matmul_bf16": "torch"})),
                       F.linear(x, weight, layer.bias))
    assert len(calls) == count
    # Shapes the tiles cannot cover fall back to oneDNN's layout (or none).
    odd = pack_weight(torch.randn(40, 64).bfloat16())
    assert odd is None or odd.layout == "onednn"


@needs_kernel
def test_amx_operands_are_checked():
    if PAIRS_MISSING is None:
        with pytest.raises(RuntimeError, match="multiple of 16"):
            torch.ops.stallfree.amx_pack(torch.randn(40, 64).bfloat16())
        with pytest.raises(RuntimeError, match="bfloat16"):
            torch.ops.stallfree.amx_pack(torch.randn(16, 32))
        packed = torch.ops.stallfree.amx_pack(torch.randn(16, 32).bfloat16())
        with pytest.raises(RuntimeError, match="does not fit"):
            torch.ops.stallfree.amx_linear(torch.randn(2, 64).bfloat16(), packed, 16)
    else:  # the op exists everywhere and says why it cannot run
        assert torch.ops.stallfree.amx_usable() is False or "permission" in AMX_MISSING
        with pytest.raises(RuntimeError, match="neither AMX"):
            torch.ops.stallfree.amx_linear(torch.randn(2, 32).bfloat16(),
                                           torch.randn(512).bfloat16(), 16)


def _within_one_bf16_step(got: torch.Tensor, ref: torch.Tensor) -> bool:
    return bool(((got.double() - ref.double()).abs()
                 <= 2 ** -8 * ref.double().abs() + 1e-30).all())


@needs_pairs
@settings(max_examples=30, deadline=None)
@given(tokens=st.integers(1, 300), half_blocks=st.integers(1, 4), k_tiles=st.integers(1, 4),
       scale=st.sampled_from([0.1, 1.0, 30.0]), seed=st.integers(0, 2**16),
       tiles=st.booleans())
def test_silu_mul_in_the_amx_epilogue_equals_the_unfused_ops(tokens, half_blocks, k_tiles,
                                                             scale, seed, tiles):
    """The fused gate/up matmul against the same matmul stored and then torch's SiLU and
    product: it rounds where they do (each product, the SiLU, the result), so it differs at
    most by the last bit where the two exponentials round a SiLU apart. Large gates (scale
    30) reach where e^-x overflows fp32."""
    gen = torch.Generator().manual_seed(seed)
    inter, cols = 32 * half_blocks, 32 * k_tiles
    x = (torch.randn(tokens, cols, generator=gen) * scale).bfloat16()
    w = torch.randn(2 * inter, cols, generator=gen).bfloat16()
    packed = pack_weight(w, gated=True)
    assert packed.layout == "amx_gated"
    fused = torch.ops.stallfree.amx_linear_silu_mul(x, packed.data, 2 * inter, tiles)
    if tiles:  # the layer's own call
        assert torch.equal(fused, gated_linear(x, w, packed))
    unfused = silu_mul(torch.ops.stallfree.amx_linear(x, pack_weight(w).data, 2 * inter, tiles))
    assert fused.shape == (tokens, inter) and fused.dtype == torch.bfloat16
    assert _within_one_bf16_step(fused, unfused)


@needs_pairs
def test_the_gated_layer_fuses_up_to_the_row_limit_and_falls_back_alike(monkeypatch):
    calls = _rows_of_calls(monkeypatch, "amx_linear_silu_mul")
    layer = GatedLinear(64, 2 * 96, bias=False).bfloat16()
    weight = layer.weight.clone()
    layer.prepack()
    assert layer.packed.layout == "amx_gated"
    sizes = (1, 33, AMX_MAX_ROWS, AMX_MAX_ROWS + 1)
    for tokens in sizes:
        x = torch.randn(tokens, 64).bfloat16()
        assert _within_one_bf16_step(layer(x), silu_mul(F.linear(x, weight)))
    # Past the limit: torch's matmul, then the two ops.
    assert calls == [t for t in sizes if t <= pair_kernel_max_rows()]
    count = len(calls)
    x = torch.randn(8, 64).bfloat16()
    assert torch.equal(gated_linear(x, layer.weight, layer.packed,
                                    choose_kernels({"matmul_bf16": "torch"})),
                       silu_mul(F.linear(x, weight)))
    assert len(calls) == count
    # Halves of a size the gated packing cannot interleave keep the plain packing, unfused.
    odd = GatedLinear(64, 2 * 48, bias=False).bfloat16()
    odd_weight = odd.weight.clone()
    odd.prepack()
    assert odd.packed.layout == "amx"
    x = torch.randn(5, 64).bfloat16()
    assert torch.equal(odd(x), silu_mul(linear(x, odd_weight, packed=odd.packed)))
    assert len(calls) == count

