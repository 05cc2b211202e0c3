"""Quantized weights kept quantized in memory: one family of row layouts ("quant rows").

A weight [N, K] is a uint8 tensor [N, row_bytes]; every row stands alone and holds
  1. the quants, K * bits / 8 bytes,
  2. one float32 (little-endian) scale per group of `group` consecutive values along K,
  3. one float32 min per group, only where `has_min`,
and element k is `scale[k // group] * q[k] + (min[k // group] if has_min else 0)`.
4-bit quants are unsigned, 16 bytes per group of 32 values, byte j = v[j] | v[j + 16] << 4
(GGML's Q4_0/Q4_1 nibble order); 8-bit quants are one int8 per value.

Why one family instead of GGUF's many block layouts: a single C++ kernel template,
parametrized by (bits, group, has_min), reads every format, and a row is a plain slice so
tensor-parallel sharding and embedding lookups need no knowledge of blocks. The price is
size: K-quants' super-blocks (6-bit packed sub-scales under an f16 super-scale) are
expanded into exact float32 scales per 32- or 16-value group, and f16 scales become
float32. Bits per weight (file format -> ours):
  q4_32  : 4 + 32/32 + 32/32 = 6  (Q4_0 4.5, Q4_1 5, Q4_K 4.5)
  q8_32  : 8 + 32/32         = 9  (Q8_0 8.5)
  q8_32  : Q5_0 (5.5) too, its 5-bit values widened to int8
  q8_32m : 8 + 64/32         = 10 (Q5_1 6, Q5_K 5.5; the 5-bit values are widened to int8)
  q8_16  : 8 + 32/16         = 10 (Q6_K 6.5625; the 6-bit values are widened to int8)
Every product that forms a scale or a min (d * sc, dmin * m) is done in float32 as gguf's
reference dequantizer does it, so `dequantize` reproduces `gguf.quants.dequantize`.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

_QK_K = 256  # values per K-quant super-block
_K_SCALE_SIZE = 12  # bytes of Q4_K/Q5_K's packed 6-bit scales and mins


@dataclass(frozen=True)
class QuantFormat:
    name: str
    bits: int
    group: int
    has_min: bool
    code: int  # the C++ kernel's switch value: must never be renumbered

    def row_bytes(self, k: int) -> int:
        groups = k // self.group
        return k * self.bits // 8 + groups * 4 * (2 if self.has_min else 1)

    def bits_per_weight(self) -> float:
        return 8 * self.row_bytes(self.group) / self.group


FORMATS: dict[str, QuantFormat] = {f.name: f for f in (
    QuantFormat("q4_32", bits=4, group=32, has_min=True, code=1),
    QuantFormat("q8_32", bits=8, group=32, has_min=False, code=2),
    QuantFormat("q8_32m", bits=8, group=32, has_min=True, code=3),
    QuantFormat("q8_16", bits=8, group=16, has_min=False, code=4),
    # Every other format's values, exactly: what the parts of a fused matmul of mixed types
    # (a Q4_K_M file's Q4_K q and k beside a Q6_K v) become, so the fusion holds one format.
    QuantFormat("q8_16m", bits=8, group=16, has_min=True, code=5),
)}

GGUF_FORMATS: dict[str, QuantFormat] = {
    "Q4_0": FORMATS["q4_32"],
    "Q4_1": FORMATS["q4_32"],
    "Q4_K": FORMATS["q4_32"],
    "Q8_0": FORMATS["q8_32"],
    "Q5_0": FORMATS["q8_32"],
    "Q5_1": FORMATS["q8_32m"],
    "Q5_K": FORMATS["q8_32m"],
    "Q6_K": FORMATS["q8_16"],
}


def _type_name(tensor_type: GGMLQuantizationType | int | str) -> str:
    if isinstance(tensor_type, str):
        return tensor_type
    return GGMLQuantizationType(int(tensor_type)).name


def gguf_format(tensor_type: GGMLQuantizationType | int | str) -> QuantFormat | None:
    """The format a GGUF tensor type is kept in; None for types loaded as floats."""
    return GGUF_FORMATS.get(_type_name(tensor_type))


# --- GGUF blocks -> quant rows (numpy; runs once at load time) ----------------------------

def _f16(b: np.ndarray) -> np.ndarray:
    """Bytes [..., 2] of a little-endian float16 -> float32 [...] (exact: f16 fits f32)."""
    return np.ascontiguousarray(b).view("<f2")[..., 0].astype(np.float32)


def _nibbles(b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    return b & np.uint8(0x0F), b >> np.uint8(4)


def _k_scale_min(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> 8 six-bit scales and 8 six-bit mins per super-block.
    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for mins; bytes 8-11 the low 4 bits of scale (low nibble) and min (high nibble) 4-7."""
    a, b, c = packed[..., 0:4], packed[..., 4:8], packed[..., 8:12]
    sc = np.concatenate([a & 0x3F, (c & 0x0F) | ((a >> 2) & 0x30)], axis=-1)
    mn = np.concatenate([b & 0x3F, (c >> 4) | ((b >> 2) & 0x30)], axis=-1)
    return sc.astype(np.float32), mn.astype(np.float32)


def _k_renibble(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [..., 128] -> our 4-bit order for the 8 sub-blocks of 32 values.
    Theirs: per 64-value chunk of 32 bytes, low nibbles are values 0..31, high nibbles
    32..63. Ours: per 32 values, byte j = v[j] | v[j + 16] << 4."""
    chunks = qs.reshape(*qs.shape[:-1], 4, 2, 16)
    a, b = chunks[..., 0, :], chunks[..., 1, :]  # bytes 0..15 and 16..31 of each chunk
    even = (a & np.uint8(0x0F)) | (b << np.uint8(4))  # sub-block 2c: the low nibbles
    odd = (a >> np.uint8(4)) | (b & np.uint8(0xF0))  # sub-block 2c+1: the high nibbles
    return np.stack([even, odd], axis=-2).reshape(qs.shape)


def _k_low4_values(qs: np.ndarray) -> np.ndarray:
    """Q4_K/Q5_K qs [..., 128] -> the low 4 bits of the 256 values, one uint8 each."""
    lo, hi = _nibbles(qs.reshape(*qs.shape[:-1], 4, 1, 32))
    return np.concatenate([lo, hi], axis=-2).reshape(*qs.shape[:-1], _QK_K)


def _convert_blocks(name: str, blk: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """blk: uint8 [rows, blocks, type_size] -> (quant bytes [rows, blocks, *],
    scales float32 [rows, blocks, groups], mins float32 like scales or None)."""
    if name == "Q4_0":
        d = _f16(blk[..., 0:2])[..., None]
        return blk[..., 2:], d, d * np.float32(-8)  # exact: x8 only moves the exponent
    if name == "Q4_1":
        return blk[..., 4:], _f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])[..., None]
    if name == "Q8_0":
        return blk[..., 2:], _f16(blk[..., 0:2])[..., None], None
    if name in ("Q5_0", "Q5_1"):
        # llama.cpp's fallback for rows a K-quant cannot cut into 256-value super-blocks
        # (a 576-wide model's Q4_K_M is mostly Q5_0). Bit j of the little-endian qh is the
        # fifth bit of value j; values 0-15 are qs' low nibbles, 16-31 its high ones.
        qs_at = 6 if name == "Q5_0" else 8
        high = np.unpackbits(blk[..., qs_at - 4:qs_at], axis=-1, bitorder="little")
        q = np.concatenate(_nibbles(blk[..., qs_at:qs_at + 16]), axis=-1) | (high << np.uint8(4))
        d = _f16(blk[..., 0:2])[..., None]
        if name == "Q5_0":  # 0..31 minus 16 as an int8, kept as its two's-complement byte
            return q - np.uint8(16), d, None
        return q, d, _f16(blk[..., 2:4])[..., None]
    if name in ("Q4_K", "Q5_K"):
        d, dmin = _f16(blk[..., 0:2])[..., None], _f16(blk[..., 2:4])[..., None]
        sc, mn = _k_scale_min(blk[..., 4:4 + _K_SCALE_SIZE])
        # gguf computes (d*sc)*q - (dmin*m); scale*q + (-(dmin*m)) rounds identically.
        scale, minimum = d * sc, -(dmin * mn)
        if name == "Q4_K":
            return _k_renibble(blk[..., 16:144]), scale, minimum
        qh, qs = blk[..., 16:48], blk[..., 48:176]
        # bit i of qh[j] is the fifth bit of value j of sub-block i
        shifts = np.arange(8, dtype=np.uint8).reshape(8, 1)
        high = ((qh[..., None, :] >> shifts) & np.uint8(1)).reshape(*qh.shape[:-1], _QK_K)
        return _k_low4_values(qs) | (high << np.uint8(4)), scale, minimum
    if name == "Q6_K":
        ql, qh = blk[..., 0:128], blk[..., 128:192]
        sc = blk[..., 192:208].view(np.int8).astype(np.float32)
        d = _f16(blk[..., 208:210])[..., None]
        # ql: per 128-value half, 64 bytes whose low nibbles are values 0..63, high 64..127;
        # qh: per half, 32 bytes whose bit pairs (0,2,4,6) are the top bits of values
        # j, j+32, j+64, j+96.
        lo, hi = _nibbles(ql.reshape(*ql.shape[:-1], 2, 1, 64))
        low4 = np.concatenate([lo, hi], axis=-2).reshape(*ql.shape[:-1], _QK_K)
        shifts = np.array([0, 2, 4, 6], dtype=np.uint8).reshape(4, 1)
        top2 = (qh.reshape(*qh.shape[:-1], 2, 1, 32) >> shifts) & np.uint8(3)
        q = low4 | (top2.reshape(*qh.shape[:-1], _QK_K) << np.uint8(4))
        # 0..63 minus 32 as an int8, kept as its two's-complement byte
        return q - np.uint8(32), d * sc, None
    raise ValueError(f"GGUF type {name} is not kept quantized")


def from_gguf(raw: np.ndarray, tensor_type: GGMLQuantizationType | int | str,
              k: int) -> np.ndarray:
    """GGUF raw blocks uint8 [rows, bytes_per_row] (K = `k` values per row) -> quant rows
    uint8 [rows, fmt.row_bytes(k)]."""
    name = _type_name(tensor_type)
    fmt = GGUF_FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"GGUF type {name} is not kept quantized "
                         f"(kept: {', '.join(GGUF_FORMATS)})")
    block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    if k <= 0 or k % block:
        raise ValueError(f"a {name} row of {k} values is not a whole number of "
                         f"{block}-value blocks")
    n_blocks = k // block
    raw = np.asarray(raw, dtype=np.uint8)
    if raw.size % (n_blocks * type_size):
        raise ValueError(f"{raw.size} bytes of {name} are not whole rows of {k} values "
                         f"({n_blocks * type_size} bytes each)")
    blk = raw.reshape(-1, n_blocks, type_size)
    rows = blk.shape[0]
    quants, scales, mins = _convert_blocks(name, blk)
    parts = [quants.reshape(rows, -1),
             scales.astype("<f4").reshape(rows, -1).view(np.uint8)]
    if mins is not None:
        parts.append(mins.astype("<f4").reshape(rows, -1).view(np.uint8))
    out = np.concatenate(parts, axis=1)
    assert out.shape[1] == fmt.row_bytes(k), (name, out.shape, fmt.row_bytes(k))
    return out


# --- quant rows -> float32 (torch; the reference the C++ kernels are checked against) ----

def _split(rows: torch.Tensor, fmt: QuantFormat, k: int
           ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """-> (q float32 [N, groups, group], scales [N, groups, 1], mins like scales or None)."""
    if k % fmt.group or rows.dtype != torch.uint8 or rows.shape[-1] != fmt.row_bytes(k):
        raise ValueError(f"expected uint8 rows of {fmt.row_bytes(k)} bytes for {fmt.name} "
                         f"with K={k}, got {rows.dtype} {tuple(rows.shape)}")
    n, groups = rows.shape[0], k // fmt.group
    qb = k * fmt.bits // 8
    if fmt.bits == 4:
        packed = rows[:, :qb].reshape(n, groups, fmt.group // 2)
        q = torch.cat([packed & 0x0F, packed >> 4], dim=-1).float()
    else:
        q = rows[:, :qb].contiguous().view(torch.int8).reshape(n, groups, fmt.group).float()
    # .contiguous() first: a float32 view needs 4-byte-aligned, packed bytes
    scales = rows[:, qb:qb + 4 * groups].contiguous().view(torch.float32)[..., None]
    mins = None
    if fmt.has_min:
        mins = rows[:, qb + 4 * groups:].contiguous().view(torch.float32)[..., None]
    return q, scales, mins


def dequantize(rows: torch.Tensor, fmt: QuantFormat, k: int) -> torch.Tensor:
    """Quant rows uint8 [N, row_bytes] -> float32 [N, K] on rows' device."""
    q, scales, mins = _split(rows, fmt, k)
    out = scales * q  # a separate multiply then add, never fused, to match gguf's rounding
    if mins is not None:
        out = out + mins
    return out.reshape(rows.shape[0], k)


def quantize_int8(weight: torch.Tensor) -> torch.Tensor:
    """float [N, K] -> q8_32 rows: symmetric int8 with one scale per output channel (row),
    repeated in each group, so a float checkpoint runs on the same kernels as GGUF Q8_0."""
    if weight.dim() != 2 or weight.shape[1] % 32:
        raise ValueError(f"quantize_int8 needs a [N, K] weight with K a multiple of 32, "
                         f"got {tuple(weight.shape)}")
    w = weight.float()
    n, k = w.shape
    scale = w.abs().amax(dim=1) / 127
    # an all-zero row: divide by 1 instead of 0 so q is 0 rather than NaN; its scale stays 0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / safe[:, None]).clamp_(-127, 127).to(torch.int8)
    scales = scale[:, None].expand(n, k // 32).contiguous()
    return torch.cat([q.view(torch.uint8), scales.view(torch.uint8)], dim=1)


def widen(rows: torch.Tensor, fmt: QuantFormat, k: int) -> torch.Tensor:
    """Rows of `fmt` as q8_16m rows holding the same values (quants widened to int8, each
    group of 32 split in two that share its scale and min)."""
    q, scales, mins = _split(rows, fmt, k)
    n, split = rows.shape[0], fmt.group // 16
    mins = torch.zeros_like(scales) if mins is None else mins
    parts = [q.to(torch.int8).reshape(n, k).view(torch.uint8)]
    for values in (scales, mins):
        parts.append(values.reshape(n, -1).repeat_interleave(split, dim=1).contiguous()
                     .view(torch.uint8))
    return torch.cat(parts, dim=1)


def fuse(parts: list[tuple[torch.Tensor, QuantFormat]], k: int
         ) -> tuple[torch.Tensor, QuantFormat]:
    """The rows of several weights stacked as one (q, k and v; gate and up), in their common
    format: theirs where they share one, else q8_16m."""
    common = common_format({fmt for _, fmt in parts})
    widened = [rows if fmt == common else widen(rows, fmt, k) for rows, fmt in parts]
    return torch.cat(widened), common


def common_format(formats: set[QuantFormat]) -> QuantFormat:
    """The format a fused weight of parts in `formats` is held in."""
    return next(iter(formats)) if len(formats) == 1 else FORMATS["q8_16m"]
