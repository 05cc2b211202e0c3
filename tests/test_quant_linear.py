"""The quantized matmul kernel (csrc/quant_linear.cpp) against the float64 product of the
reference dequantizer (quant_formats.dequantize), its panels (csrc/quant_panels.cpp: quant
rows 8 side by side, and read back), and linear.quant_linear's choice of it.

The bound. x is quantized per row in blocks of 32: d_b = amax_b / 127, q_i = round(x_i / d_b),
so |x_i - d_b q_i| <= d_b / 2 = amax_b / 254. A weight is w_i = s_i p_i + m_i (scale, quant,
min of its group; m = 0 without mins). The kernel sums s_i p_i d_b q_i (integer products
scaled in float) and takes the min term from x itself, m_g * (sum of x over group g), so
    out - x . w = sum_i s_i p_i (d_b q_i - x_i)
    |out - x . w| <= sum_b amax_b / 254 * sum_{i in b} |s_i p_i|
(|s p| = |w - m|, not |w|: a min is never multiplied by a quantized x), plus float32
rounding, well inside 1e-4 of |x| . (|s p| + |m|) and 1e-5 absolute. The bound is loose (every
rounding of x against the sum); `kernel_model` is the kernel's arithmetic itself (x quantized
as the kernel does, in float32 with round half to even, the rest in float64), which the
kernel meets within float32 rounding (measured: at most 1.5e-7 of the sum of |terms|).
Without a built kernel library the tests skip, saying why.
"""
from __future__ import annotations

import gguf
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.linear import gated_linear, linear, quant_linear, silu_mul
from stallfree.model.packing import PackedWeight
from stallfree.model.quant_formats import FORMATS, QuantFormat, dequantize, from_gguf

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
NAMES = sorted(FORMATS)


def op(gated: bool):
    ops = torch.ops.stallfree
    return ops.quant_linear_silu_mul if gated else ops.quant_linear


def pack(rows: torch.Tensor, fmt: QuantFormat, k: int) -> torch.Tensor:
    return torch.ops.stallfree.quant_pack_panels(rows, k, fmt.code)


def matmul(x, rows, fmt, k, gated=False) -> torch.Tensor:
    """The kernel on quant rows [N, row_bytes]: packed into panels, as the loader does."""
    return op(gated)(x, pack(rows, fmt, k), rows.shape[0], k, fmt.code)


def random_rows(fmt: QuantFormat, n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """uint8 [n, row_bytes]: random quant bytes, scales in [0, 0.1), mins ~ 0.1 N(0, 1)."""
    groups = k // fmt.group
    parts = [torch.randint(0, 256, (n, k * fmt.bits // 8), dtype=torch.uint8, generator=gen),
             (torch.rand(n, groups, generator=gen) * 0.1).view(torch.uint8)]
    if fmt.has_min:
        parts.append((torch.randn(n, groups, generator=gen) * 0.1).view(torch.uint8))
    return torch.cat(parts, dim=1)


def random_x(m: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """Activations with outliers: every 37th column 20x larger, as a block's amax is."""
    x = torch.randn(m, k, generator=gen)
    x[:, ::37] *= 20
    return x


def split(rows: torch.Tensor, fmt: QuantFormat, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(s * p, m) per weight value, float64 [N, K] each, w = s * p + m."""
    scale_at = k * fmt.bits // 8
    min_at = scale_at + 4 * k // fmt.group
    sp_rows, m_rows = rows.clone(), rows.clone()
    sp_rows[:, min_at:] = 0  # mins 0: dequantize gives s * p alone
    m_rows[:, scale_at:min_at] = 0  # scales 0: dequantize gives the mins alone
    return dequantize(sp_rows, fmt, k).double(), dequantize(m_rows, fmt, k).double()


def bound(x: torch.Tensor, rows: torch.Tensor, fmt: QuantFormat, k: int) -> torch.Tensor:
    """The module docstring's bound, [M, N] in float64."""
    (sp, mins), xd = (part.abs() for part in split(rows, fmt, k)), x.double()
    amax = xd.abs().reshape(x.shape[0], -1, 32).amax(-1)  # [M, K / 32]
    quantization = (amax / 254) @ sp.reshape(sp.shape[0], -1, 32).sum(-1).t()
    rounding = 1e-4 * (xd.abs() @ (sp + mins).t()) + 1e-5
    return 1.0001 * quantization + rounding


def kernel_model(x: torch.Tensor, rows: torch.Tensor, fmt: QuantFormat, k: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x quantized per block of 32 as the kernel does) . (s * p) + x . m in float64, and the
    sum of the absolute terms (the scale of its float32 rounding)."""
    blocks = x.float().reshape(x.shape[0], -1, 32)
    d = blocks.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))
    x_hat = (torch.round(blocks * inv) * d).reshape(x.shape).double()
    (sp, mins), xd = split(rows, fmt, k), x.double()
    return (x_hat @ sp.t() + xd @ mins.t(),
            x_hat.abs() @ sp.abs().t() + xd.abs() @ mins.abs().t())


def assert_within_bound(out, x, rows, fmt, k) -> None:
    exact = x.double() @ dequantize(rows, fmt, k).double().t()
    excess = (out.double() - exact).abs() - bound(x, rows, fmt, k)
    assert out.shape == exact.shape and out.dtype == x.dtype
    assert float(excess.max()) <= 0, f"{fmt.name}: beyond the bound by {float(excess.max())}"
    model, scale = kernel_model(x, rows, fmt, k)
    off = (out.double() - model).abs() - (2e-6 * scale + 1e-6)
    assert float(off.max()) <= 0, f"{fmt.name}: off the kernel's arithmetic by {float(off.max())}"


@settings(max_examples=80, deadline=None)
@given(name=st.sampled_from(NAMES), m=st.integers(1, 20), n=st.integers(1, 70),
       k=st.sampled_from([32, 64, 96, 160, 576]), gated=st.booleans(),
       seed=st.integers(0, 2**31 - 1))
def test_kernel_within_the_quantization_bound(name, m, n, k, gated, seed):
    """Rows of x 1..20 and N 1..70: every edge of the panels of 8 rows and of the passes of
    4 rows of x. Gated, N is a multiple of 16 (the up rows start a panel)."""
    fmt = FORMATS[name]
    gen = torch.Generator().manual_seed(seed)
    n = -(-n // 16) * 16 if gated else n
    rows, x = random_rows(fmt, n, k, gen), random_x(m, k, gen)
    plain = matmul(x, rows, fmt, k)
    assert_within_bound(plain, x, rows, fmt, k)
    if gated:
        fused = matmul(x, rows, fmt, k, gated=True)
        assert fused.shape == (m, n // 2)
        torch.testing.assert_close(fused, silu_mul(plain), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", NAMES)
def test_panels_read_back_the_rows(name):
    fmt, k, n = FORMATS[name], 96, 13  # a last panel of 5 rows
    rows = random_rows(fmt, n, k, torch.Generator().manual_seed(8))
    panels = pack(rows, fmt, k)
    assert panels.shape == (2, 8 * fmt.row_bytes(k))  # the same bytes, padded to 16 rows
    read = torch.ops.stallfree.quant_panel_rows
    assert torch.equal(read(panels, torch.arange(n), n, k, fmt.code), rows)
    ids = torch.tensor([12, 0, 7, 8, 12])
    assert torch.equal(read(panels, ids, n, k, fmt.code), rows[ids])
    for bad in (13, -1):
        with pytest.raises(RuntimeError, match="outside"):
            read(panels, torch.tensor([bad]), n, k, fmt.code)


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("gated", [False, True])
def test_bfloat16_x_is_the_float32_result_rounded(name, gated):
    fmt, k, n = FORMATS[name], 160, 32
    gen = torch.Generator().manual_seed(1)
    rows, x = random_rows(fmt, n, k, gen), random_x(7, k, gen).bfloat16()
    out = matmul(x, rows, fmt, k, gated)
    assert out.dtype == torch.bfloat16
    # x in bf16 widens to float32 exactly; the float32 result is rounded once to bf16.
    assert torch.equal(out, matmul(x.float(), rows, fmt, k, gated).bfloat16())


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("gated", [False, True])
def test_each_row_of_x_alone_gives_the_same_bits(name, gated):
    """Batch invariance: a row's output is the same whichever rows share its tiles."""
    fmt, k, n = FORMATS[name], 96, 16 if gated else 14
    gen = torch.Generator().manual_seed(2)
    rows, x = random_rows(fmt, n, k, gen), random_x(11, k, gen)
    panels = pack(rows, fmt, k)
    together = op(gated)(x, panels, n, k, fmt.code)
    alone = torch.cat([op(gated)(x[i:i + 1], panels, n, k, fmt.code) for i in range(11)])
    assert torch.equal(together, alone)
    assert torch.equal(together[3:9], op(gated)(x[3:9], panels, n, k, fmt.code))


def test_zero_rows_and_zero_x():
    fmt, k, n = FORMATS["q4_32"], 64, 6
    rows = random_rows(fmt, n, k, torch.Generator().manual_seed(3))
    assert matmul(torch.zeros(0, k), rows, fmt, k).shape == (0, n)
    # amax 0: quants and scale 0 (no division by zero); the min term's sum of x is 0 too.
    assert torch.equal(matmul(torch.zeros(3, k), rows, fmt, k), torch.zeros(3, n))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("gated", [False, True])
def test_quant_linear_takes_the_table_choice(name, gated):
    fmt, k, n = FORMATS[name], 64, 16 if gated else 12
    gen = torch.Generator().manual_seed(4)
    rows, x = random_rows(fmt, n, k, gen), random_x(5, k, gen)
    packed = PackedWeight(pack(rows, fmt, k), fmt.name, (n, k))
    bias = None if gated else torch.randn(n, generator=gen)
    run = gated_linear if gated else linear
    extra = () if gated else (bias,)

    torch_path = choose_kernels({"matmul_quant": "torch"})
    assert not torch_path.matmul_quant.kernel
    reference = F.linear(x, dequantize(rows, fmt, k), bias)
    reference = silu_mul(reference) if gated else reference
    assert torch.equal(quant_linear(x, packed, bias, torch_path, gated), reference)
    assert torch.equal(run(x, None, *extra, packed=packed, kernels=torch_path), reference)

    kernel = choose_kernels({"matmul_quant": "kernel"})
    assert kernel.matmul_quant.kernel
    expected = matmul(x, rows, fmt, k, gated)
    expected = expected if bias is None else expected + bias
    assert torch.equal(quant_linear(x, packed, bias, kernel, gated), expected)
    assert torch.equal(run(x, None, *extra, packed=packed, kernels=kernel), expected)
    # The kernel's product differs from the float one (x is quantized): the paths differ.
    assert not torch.equal(expected, reference)


def test_bad_inputs_raise_with_a_reason():
    fmt, k, n = FORMATS["q4_32"], 64, 4
    rows = random_rows(fmt, n, k, torch.Generator().manual_seed(6))
    panels, x = pack(rows, fmt, k), torch.randn(2, k)
    cases = [
        ((x, rows, n, k, fmt.code), "the panels of"),  # rows, not panels
        ((x, panels, 9, k, fmt.code), "the panels of"),  # 9 rows take two panels
        ((x, panels.view(torch.int8), n, k, fmt.code), "the panels of"),
        ((x, panels, n, k, 2), "the panels of"),  # q8_32 panels are larger
        ((torch.randn(2, 48), panels, n, 48, fmt.code), "multiple of 32"),
        ((torch.randn(2, 32), panels, n, k, fmt.code), "multiple of 32"),  # x's K is not k
        ((x, panels, n, k, 9), "unknown format code"),
    ]
    for args, message in cases:
        with pytest.raises(RuntimeError, match=message):
            op(False)(*args)
    with pytest.raises(RuntimeError, match="multiple of 16"):  # the up rows mid-panel
        op(True)(x, pack(random_rows(fmt, 8, k, torch.Generator()), fmt, k), 8, k, fmt.code)
    with pytest.raises(RuntimeError, match="uint8 rows"):
        pack(rows[:, :-4].contiguous(), fmt, k)
    q8_16 = FORMATS["q8_16"]  # valid quant rows of K = 48, which panels do not take
    with pytest.raises(RuntimeError, match="multiple of 32"):
        pack(random_rows(q8_16, n, 48, torch.Generator()), q8_16, 48)


def test_the_default_models_q4_1_tensor():
    """blk.0.ffn_down.weight of the default GGUF (Q4_1, [576, 1536]) through from_gguf:
    real scales and mins, x rows strided as a slice of a wider tensor."""
    from stallfree.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    tensor = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert tensor.tensor_type.name == "Q4_1"
    k = int(tensor.shape[0])  # gguf lists dims innermost first
    rows = torch.from_numpy(from_gguf(tensor.data, tensor.tensor_type, k))
    assert rows.shape[0] == int(tensor.shape[1]) == 576
    fmt = FORMATS["q4_32"]
    gen = torch.Generator().manual_seed(7)
    x = random_x(6, 2 * k, gen)[:, ::2]
    assert not x.is_contiguous()
    out = matmul(x, rows, fmt, k)
    assert_within_bound(out, x, rows, fmt, k)
    # Not vacuous: reading the nibbles the wrong way round (v[j + 16] | v[j] << 4) breaks
    # the bound at a third of the outputs (measured: 34%).
    swapped = rows.clone()
    quants = swapped[:, :k // 2]
    swapped[:, :k // 2] = (quants >> 4) | (quants << 4)
    exact = x.double() @ dequantize(rows, fmt, k).double().t()
    wrong = x.double() @ dequantize(swapped, fmt, k).double().t()
    assert float(((wrong - exact).abs() > bound(x, rows, fmt, k)).double().mean()) > 0.1
