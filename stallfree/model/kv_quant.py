"""The quantized KV cache (`kv_cache_dtype="int8"`): its layout, and its writes and reads in
torch.

A float cache is [layers, 2, blocks, block_size, kv_heads, head_dim] in the model dtype. An
int8 cache is [layers, 2, blocks, block_size, kv_heads, head_dim + 4] int8: each (token,
head) row holds head_dim int8 values q, then 4 bytes, the row's float32 scale s in native
byte order, with x ~ s * q. Symmetric per token and head: s = max|x| / 127 (in float32),
q = round-half-to-even(x / s) clamped to [-127, 127], and a row whose s is 0 (all zeros)
holds q = 0, so the zeroed null block reads as zeros. A row costs head_dim + 4 bytes
against 4 * head_dim in float32: at head_dim 64, 3.8x the tokens in the same memory, and
decode attention (which streams the cache) reads that many fewer bytes.

The C++ writer (csrc/rope_cache.cpp) and the kernels that read the cache in place follow
the same arithmetic: a row written there equals `quantize`'s bit for bit (tests/
test_kv_int8.py). fp8 is not built: see `check_kv_cache_dtype`'s message.
"""
from __future__ import annotations

import torch

SCALE_BYTES = 4  # one float32 scale after each row's values
Q_MAX = 127  # symmetric: -128 is never stored
QUANTIZED_DTYPES = (torch.int8,)
# The names of the `kv_cache_dtype` setting (config.KV_CACHE_DTYPES) that hold a quantized
# cache, as the cache's torch dtype; "auto" is the model's dtype.
_BY_NAME = {"int8": torch.int8}


def cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's torch dtype for the `kv_cache_dtype` setting `name` ("auto": the
    model's)."""
    if name == "auto":
        return model_dtype
    if name not in _BY_NAME:
        raise ValueError(f"kv_cache_dtype {name!r} has no cache layout here "
                         f"(built: auto, {', '.join(_BY_NAME)})")
    return _BY_NAME[name]


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in QUANTIZED_DTYPES


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """The cache's last dimension for heads of `head_dim` in a cache of `dtype`."""
    if not is_quantized(dtype):
        return head_dim
    if head_dim % SCALE_BYTES:
        # The scale is read as a float32 view of each row's tail, which must be aligned.
        raise ValueError(f"an int8 KV cache needs head_dim % {SCALE_BYTES} == 0, "
                         f"got {head_dim}")
    return head_dim + SCALE_BYTES


def head_dim(kv_cache: torch.Tensor) -> int:
    """The head size of a cache (any leading dims), its scale bytes left out."""
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if is_quantized(kv_cache.dtype) else width


def compute_dtype(cache: torch.dtype, query: torch.dtype = torch.float32) -> torch.dtype:
    """The dtype attention computes in over a cache of `cache`: its own for a float cache,
    the query's for a quantized one (its rows are dequantized to it)."""
    return query if is_quantized(cache) else cache


def quantize(x: torch.Tensor) -> torch.Tensor:
    """Rows [..., D] of any float dtype -> [..., D + 4] int8 in the cache's row layout."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True) / Q_MAX
    # x / s, not x * (1 / s): the C++ writer divides too, and the two must agree to the bit.
    q = torch.where(scale > 0, x / scale, 0.0).round_().clamp_(-Q_MAX, Q_MAX)
    rows = torch.empty((*x.shape[:-1], x.shape[-1] + SCALE_BYTES), dtype=torch.int8,
                       device=x.device)
    rows[..., :-SCALE_BYTES] = q.to(torch.int8)
    rows[..., -SCALE_BYTES:] = scale.view(torch.int8)
    return rows


def scales(rows: torch.Tensor) -> torch.Tensor:
    """The float32 scale of each row [..., D + 4] -> [..., 1]."""
    tail = rows[..., -SCALE_BYTES:]
    if rows.stride(-1) != 1 or rows.storage_offset() % SCALE_BYTES:
        tail = tail.contiguous()  # a view needs 4-byte aligned, unit-stride tails
    return tail.view(torch.float32)


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Cache rows [..., W] -> values [..., D] in `dtype`: s * q (in float32, then rounded to
    `dtype`) for a quantized cache, a plain conversion for a float one."""
    if not is_quantized(rows.dtype):
        return rows.to(dtype)
    return (rows[..., :-SCALE_BYTES].float() * scales(rows)).to(dtype)


def as_cached(x: torch.Tensor, cache: torch.dtype) -> torch.Tensor:
    """x [..., D] as a cache of `cache` would give it back: attention over a chunk's own
    keys then sees what later chunks (and the kernels) read, whatever the chunking."""
    return dequantize(quantize(x), x.dtype) if is_quantized(cache) else x


def write(kv_cache: torch.Tensor, slots: torch.Tensor, k: torch.Tensor,
          v: torch.Tensor) -> None:
    """k and v [T, Hkv, D] into one layer's cache [2, blocks, block_size, Hkv, W] at the
    flat slots [T] (block * block_size + offset): converted to a float cache's dtype, or
    quantized into an int8 one's rows."""
    width = kv_cache.shape[-1]
    for i, x in enumerate((k, v)):
        rows = quantize(x) if is_quantized(kv_cache.dtype) else x.to(kv_cache.dtype)
        kv_cache[i].view(-1, x.shape[1], width).index_copy_(0, slots, rows)
