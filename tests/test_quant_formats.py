"""GGUF blocks -> quant rows -> float32 must reproduce gguf's own dequantizer."""
from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model.quant_formats import (
    FORMATS,
    GGUF_FORMATS,
    dequantize,
    from_gguf,
    gguf_format,
    quantize_int8,
)

# Byte offsets of each type's float16 super-scales inside a block: random bytes there would
# give inf/NaN/huge scales, so the tests overwrite them with moderate float16 values.
F16_OFFSETS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q8_0": (0,), "Q5_0": (0,), "Q5_1": (0, 2),
    "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
}


def random_blocks(name: str, n: int, blocks: int, seed: int) -> np.ndarray:
    """uint8 [n, blocks * type_size]: random quants and sub-scales, sane f16 scales
    (negative, zero and subnormal included: gguf's arithmetic must hold for them too)."""
    rng = np.random.default_rng(seed)
    _, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = rng.integers(0, 256, size=(n, blocks, type_size), dtype=np.uint8)
    for off in F16_OFFSETS[name]:
        d = rng.uniform(-4.0, 4.0, size=(n, blocks)).astype(np.float16)
        d[rng.random((n, blocks)) < 0.1] = 0
        d[rng.random((n, blocks)) < 0.1] = np.float16(3e-7)  # a float16 subnormal
        raw[..., off:off + 2] = d.astype("<f2").view(np.uint8).reshape(n, blocks, 2)
    return raw.reshape(n, blocks * type_size)


def bits(x: np.ndarray) -> np.ndarray:
    # +0.0 first: Q4_0's scale*q + (-8*scale) gives +0 where gguf's scale*(q-8) gives -0
    # for a negative scale; every other bit must match.
    return (np.asarray(x, dtype=np.float32) + np.float32(0)).view(np.uint32)


def reference(raw: np.ndarray, name: str, n: int, k: int) -> np.ndarray:
    return gguf.quants.dequantize(raw, GGMLQuantizationType[name]).reshape(n, k)


@pytest.mark.parametrize("name", sorted(GGUF_FORMATS))
@settings(max_examples=12, deadline=None)
@given(n=st.integers(1, 5), blocks=st.integers(1, 4), seed=st.integers(0, 2**32 - 1))
def test_from_gguf_matches_gguf_dequantize(name: str, n: int, blocks: int, seed: int) -> None:
    block, _ = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    k = blocks * block
    raw = random_blocks(name, n, blocks, seed)
    fmt = gguf_format(GGMLQuantizationType[name])
    assert fmt is GGUF_FORMATS[name]
    rows = from_gguf(raw, GGMLQuantizationType[name], k)
    assert rows.dtype == np.uint8 and rows.shape == (n, fmt.row_bytes(k))
    ours = dequantize(torch.from_numpy(rows), fmt, k)
    assert ours.dtype == torch.float32 and ours.shape == (n, k)
    # Bit-exact for every type (Q4_0 up to the sign of zero, see bits()): every scale/min
    # is formed with gguf's float32 products and the final multiply and add round the same
    # way as gguf's expression, so no tolerance is needed.
    np.testing.assert_array_equal(bits(ours.numpy()), bits(reference(raw, name, n, k)))


def test_formats_and_bits_per_weight() -> None:
    assert {f.name: f.code for f in FORMATS.values()} == {
        "q4_32": 1, "q8_32": 2, "q8_32m": 3, "q8_16": 4, "q8_16m": 5}
    assert {f.name: f.bits_per_weight() for f in FORMATS.values()} == {
        "q4_32": 6.0, "q8_32": 9.0, "q8_32m": 10.0, "q8_16": 10.0, "q8_16m": 12.0}
    assert FORMATS["q4_32"].row_bytes(576) == 288 + 18 * 8
    for t in (GGMLQuantizationType.F32, GGMLQuantizationType.F16,
              GGMLQuantizationType.BF16, GGMLQuantizationType.IQ4_NL):
        assert gguf_format(t) is None
    assert gguf_format(int(GGMLQuantizationType.Q6_K)) is FORMATS["q8_16"]


def test_four_bit_nibble_order() -> None:
    # Q4_1 with d=1, m=0: value j of a group is byte j's low nibble, value j+16 its high one
    raw = np.zeros((1, 20), dtype=np.uint8)
    raw[0, 0:2] = np.array([1.0], dtype="<f2").view(np.uint8)
    low = np.arange(16, dtype=np.uint8)
    raw[0, 4:20] = low | (np.uint8(15) - low) << 4
    out = dequantize(torch.from_numpy(from_gguf(raw, "Q4_1", 32)), FORMATS["q4_32"], 32)
    assert out[0].tolist() == list(range(16)) + list(range(15, -1, -1))


@pytest.mark.parametrize("name", ["Q4_0", "Q4_K", "Q6_K", "Q8_0"])
def test_k_not_multiple_of_block(name: str) -> None:
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    raw = np.zeros((2, type_size), dtype=np.uint8)
    with pytest.raises(ValueError, match="not a whole number"):
        from_gguf(raw, name, block + block // 2)
    with pytest.raises(ValueError, match="not kept quantized"):
        from_gguf(raw, "IQ4_NL", block)


@settings(max_examples=20, deadline=None)
@given(n=st.integers(1, 6), groups=st.integers(1, 5), seed=st.integers(0, 2**32 - 1),
       zero_row=st.booleans())
def test_quantize_int8_error_within_half_step(n: int, groups: int, seed: int,
                                              zero_row: bool) -> None:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, groups * 32, generator=gen) * torch.rand(n, 1, generator=gen) * 10
    if zero_row:
        w[0] = 0
    fmt = FORMATS["q8_32"]
    rows = quantize_int8(w)
    assert rows.dtype == torch.uint8 and rows.shape == (n, fmt.row_bytes(groups * 32))
    back = dequantize(rows, fmt, groups * 32)
    assert torch.isfinite(back).all()
    scale = w.abs().amax(dim=1, keepdim=True) / 127
    assert ((back - w).abs() <= scale / 2 + 1e-6 * scale + 1e-30).all()
    if zero_row:
        assert (back[0] == 0).all() and (rows[0] == 0).all()


def test_quantize_int8_rejects_ragged_k() -> None:
    with pytest.raises(ValueError):
        quantize_int8(torch.ones(2, 40))




def test_default_model_tensors() -> None:
    from stallfree.model.loader import default_model_path

    reader = gguf.GGUFReader(default_model_path())
    tensors = {t.name: t for t in reader.tensors}
    for name, expected in (("blk.0.ffn_down.weight", "Q4_1"), ("token_embd.weight", "Q8_0")):
        t = tensors[name]
        assert t.tensor_type.name == expected
        k, n = int(t.shape[0]), int(t.shape[1])  # gguf lists dims innermost first
        fmt = gguf_format(t.tensor_type)
        rows = from_gguf(t.data, t.tensor_type, k)
        ours = dequantize(torch.from_numpy(rows), fmt, k).numpy()
        theirs = gguf.quants.dequantize(t.data, t.tensor_type).reshape(n, k)
        np.testing.assert_array_equal(ours.view(np.uint32), theirs.view(np.uint32))
