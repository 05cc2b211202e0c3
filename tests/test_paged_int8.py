"""The decode and prefill attention kernels over an int8 KV cache read in place
(csrc/paged_int8.h, paged_decode_int8.h, paged_prefill_f32.h), against the same kernels over
the float32 cache of the dequantized values (s * q): the two compute the same math.

Decode scales each score by its K row's scale after the dot product and folds the V row's
scale into the softmax weight, so it agrees with the float kernel to float32 rounding;
prefill dequantizes each step's rows to s * q first and then runs the float32 loops, so it
agrees to the bit. The cache layout: [2, blocks, block_size, Hkv, D + 4] int8, each row D
values q then its float32 scale s, x ~ s * q (s = max|x| / 127; an all-zero row holds s = 0
and q = 0).
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_batch import Batch, rel_err
from stallfree.model import paged_decode as decode_kernel
from stallfree.model import paged_prefill as prefill_kernel
from stallfree.model.kernel_table import choose_kernels, default_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.paged_decode import AUTO_SPLIT, paged_decode
from stallfree.model.paged_prefill import paged_prefill

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
# Decode against the float kernel: float32 rounding of the output (observed ~1e-7).
DECODE_TOL = 2e-6
HEADS = [(9, 3, 64), (8, 2, 64), (4, 4, 64), (10, 2, 64), (16, 1, 64), (8, 2, 128),
         (4, 2, 32), (4, 2, 16)]
CONTEXTS = [1, 2, 15, 16, 17, 31, 33, 100, 511, 512, 1000]
WINDOWS = [(None, None), (16, None), (37, None), (None, 2.0), (37, 2.0)]
# (cached, new) prefill chunks: a whole prompt, a chunk after a prefix that its first
# queries see, a short chunk after a long prefix, a two-token chunk.
CHUNKS = [(0, 70), (50, 40), (300, 17), (20, 2)]


def quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows [..., D] -> (the int8 cache's rows [..., D + 4], their values s * q in float32)."""
    x = x.float()
    s = x.abs().amax(-1, keepdim=True) / 127
    q = torch.where(s > 0, x / s, 0.0).round().clamp(-127, 127)
    rows = torch.cat([q.to(torch.int8), s.view(torch.int8)], -1).contiguous()
    return rows, q * s


class Int8Batch(Batch):
    """A Batch whose random cache is quantized: `int8` the cache, `cache` its values."""

    def __init__(self, heads, block_size: int = 16, num_blocks: int = 600, seed: int = 0):
        super().__init__(heads, block_size=block_size, num_blocks=num_blocks, seed=seed)
        self.int8, self.cache = quantize(self.cache)

    def junk_past(self, seqs) -> None:
        """Past each request's context in its last block: rows of int8 junk under NaN scales
        (a block's previous owner may leave anything), in both caches."""
        nan = torch.tensor([float("nan")]).view(torch.int8)
        for start, n, table in seqs:
            end = (start + n) % self.block_size
            if end:
                self.int8[:, table[-1], end:, :, -4:] = nan
                self.int8[:, table[-1], end:, :, :-4] = 127
                self.cache[:, table[-1], end:] = float("nan")


def _tables(seqs) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(t) for _, _, t in seqs)
    tables = torch.tensor([t + [0] * (width - len(t)) for _, _, t in seqs], dtype=torch.long)
    return tables, torch.tensor([s + n for s, n, _ in seqs], dtype=torch.long)


def _decode(batch: Int8Batch, seqs, q, cache, split=AUTO_SPLIT, window=None, softcap=None,
            threads=None) -> torch.Tensor:
    tables, lens = _tables(seqs)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        return paged_decode(q, cache, tables, lens, batch.dim ** -0.5, split, window=window,
                            softcap=softcap)
    finally:
        torch.set_num_threads(saved)


def _decode_both(batch: Int8Batch, contexts, **kw) -> tuple[torch.Tensor, torch.Tensor]:
    """Decodes at `contexts` over the int8 cache and over the float cache of its values."""
    seqs = batch.decodes(contexts)
    q = batch.qkv(len(seqs))[0]
    return tuple(_decode(batch, seqs, q, cache, **kw) for cache in (batch.int8, batch.cache))


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "q{}_kv{}_d{}".format(*h))
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_decodes_match_the_float_kernel_on_the_dequantized_cache(heads, window, softcap):
    """GQA groups of 1-16 (more than one pass of heads per KV head from 5 up), 16-128 dims,
    contexts from 1 token to 1,000, none to several 32-token tiles and their tails."""
    batch = Int8Batch(heads, num_blocks=800)
    out, ref = _decode_both(batch, CONTEXTS, window=window, softcap=softcap)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    for i, context in enumerate(CONTEXTS):
        assert rel_err(out[i], ref[i]) < DECODE_TOL, f"context {context}"


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("split", [0, 16, 48, AUTO_SPLIT])
@pytest.mark.parametrize("rows", [1, 3, 8, 32])
def test_batches_splits_and_threads(threads, split, rows):
    batch = Int8Batch((9, 3, 64), num_blocks=1300)
    seqs = batch.decodes([(37 * i * i + 5) % 600 + 1 for i in range(rows)])
    q = batch.qkv(rows)[0]
    out = _decode(batch, seqs, q, batch.int8, split, threads=threads)
    assert rel_err(out, _decode(batch, seqs, q, batch.cache, split, threads=threads)) < DECODE_TOL
    # Requests cut into parts and merged: the same beyond rounding.
    whole = _decode(batch, seqs, q, batch.int8, 0, threads=1)
    assert rel_err(out, whole) < DECODE_TOL


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_queries_are_widened(dtype):
    """The query in any of the kernel's dtypes is widened to fp32: the output, in q's dtype,
    is the float kernel's on the same (rounded) query, rounded once."""
    batch = Int8Batch((9, 3, 64))
    seqs = batch.decodes([7, 64, 300, 900])
    q = batch.qkv(len(seqs))[0].to(dtype)
    out = _decode(batch, seqs, q, batch.int8)
    ref = _decode(batch, seqs, q.float(), batch.cache)
    assert out.dtype == dtype
    assert rel_err(out, ref) < (2 ** -8 if dtype == torch.bfloat16 else 2 ** -11)


def test_junk_past_the_context_does_not_reach_the_output():
    batch = Int8Batch((9, 3, 64), num_blocks=64)
    seqs = batch.decodes([5, 21, 40, 100])
    batch.junk_past(seqs)
    q = batch.qkv(len(seqs))[0]
    out = _decode(batch, seqs, q, batch.int8)
    assert torch.isfinite(out).all()
    assert rel_err(out, _decode(batch, seqs, q, batch.cache)) < DECODE_TOL


def test_all_zero_rows_weigh_as_zero_keys():
    """A row quantized from zeros (s = 0, q = 0) scores 0 and adds nothing."""
    batch = Int8Batch((9, 3, 64))
    seqs = batch.decodes([40, 77])
    for _, _, table in seqs:
        batch.int8[:, table[0], 3:9] = 0
        batch.cache[:, table[0], 3:9] = 0
    q = batch.qkv(2)[0]
    out = _decode(batch, seqs, q, batch.int8)
    assert rel_err(out, _decode(batch, seqs, q, batch.cache)) < DECODE_TOL


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contexts=st.lists(st.integers(1, 700), min_size=1, max_size=12),
       heads=st.sampled_from(HEADS), block_size=st.sampled_from([8, 16, 32]),
       seed=st.integers(0, 2**16), split=st.sampled_from([0, 16, 64, AUTO_SPLIT]),
       window=st.sampled_from([None, 1, 33, 200]))
def test_property_any_decode_batch(contexts, heads, block_size, seed, split, window):
    batch = Int8Batch(heads, block_size=block_size, num_blocks=12 * 700 // block_size + 12,
                      seed=seed)
    out, ref = _decode_both(batch, contexts, split=split, window=window)
    assert rel_err(out, ref) < DECODE_TOL


def _prefill(batch: Int8Batch, seqs, q, cache, window=None, softcap=None, threads=None):
    tables, lens = _tables(seqs)
    query_lens = torch.tensor([n for _, n, _ in seqs], dtype=torch.long)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        return paged_prefill(q, cache, tables, query_lens, lens, batch.dim ** -0.5,
                             window=window, softcap=softcap)
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("heads", [(9, 3, 64), (8, 2, 128), (12, 2, 32), (16, 1, 64)],
                         ids=lambda h: "q{}_kv{}_d{}".format(*h))
@pytest.mark.parametrize("window,softcap", WINDOWS)
def test_prefill_chunks_equal_the_float_kernel_on_the_dequantized_cache(
        threads, block_size, heads, window, softcap):
    """Chunks with and without a cached prefix, junk past each context: the float32 path's
    loops over rows dequantized to the bit, so the outputs are equal."""
    batch = Int8Batch(heads, block_size=block_size, num_blocks=4000 // block_size)
    seqs = [(c, n, batch.table(c + n)) for c, n in CHUNKS]
    batch.junk_past(seqs)
    q = batch.qkv(sum(n for _, n, _ in seqs))[0]
    out = _prefill(batch, seqs, q, batch.int8, window, softcap, threads)
    ref = _prefill(batch, seqs, q, batch.cache, window, softcap, threads)
    assert torch.isfinite(out).all()
    assert torch.equal(out, ref)


def test_prefill_under_a_bf16_query_is_the_float32_path_rounded():
    batch = Int8Batch((9, 3, 64))
    seqs = [(c, n, batch.table(c + n)) for c, n in CHUNKS]
    q = batch.qkv(sum(n for _, n, _ in seqs))[0].bfloat16()
    out = _prefill(batch, seqs, q, batch.int8)
    ref = _prefill(batch, seqs, q.float(), batch.cache)
    assert out.dtype == torch.bfloat16
    assert torch.equal(out, ref.bfloat16())


def test_usable_takes_the_head_size_from_the_row():
    """usable() on an int8 cache: head_dim is the row's width less its 4 scale bytes."""
    table = default_kernels()
    for dim in (16, 32, 64, 128):
        cache = torch.zeros(2, 4, 16, 2, dim + 4, dtype=torch.int8)
        assert decode_kernel.usable(cache, table)
        assert prefill_kernel.usable(cache, table) == (dim % 32 == 0)
    for width in (64, 52):  # no scale bytes after 64 values; 48 values
        cache = torch.zeros(2, 4, 16, 2, width, dtype=torch.int8)
        assert not decode_kernel.usable(cache, table)
        assert not prefill_kernel.usable(cache, table)
    off = choose_kernels({"decode_attention": "torch", "prefill_attention": "torch"})
    cache = torch.zeros(2, 4, 16, 2, 68, dtype=torch.int8)
    assert not decode_kernel.usable(cache, off) and not prefill_kernel.usable(cache, off)


def test_a_row_without_its_scale_is_refused():
    q = torch.randn(1, 4, 64)
    bare = torch.zeros(2, 4, 16, 2, 64, dtype=torch.int8)
    with pytest.raises(RuntimeError, match="head_dim"):
        paged_decode(q, bare, torch.tensor([[0]]), torch.tensor([5]), 0.125)
    with pytest.raises(RuntimeError, match="head_dim"):
        paged_prefill(q, bare, torch.tensor([[0]]), torch.tensor([1]), torch.tensor([5]),
                      0.125)
