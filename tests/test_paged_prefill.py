"""The prefill-attention kernel (stallfree/model/paged_prefill.py): over a bf16 cache its
AMX tiles and AVX512_BF16 vectors against fp32 math, over a float32 cache its float vectors
against fp64 math, and both against the torch reference path (gather + SDPA with the
chunk's causal mask).

On a CPU without AVX512_BF16 the bf16 tests skip, and say which flag is missing; on one
without AMX the tile path falls back to the vectors, so both cases test those. The float32
path needs only the kernels built. The torch path they compare with runs everywhere.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_batch import Batch, rel_err
from kernel_paths import engine_kernels
from stallfree.model import paged_prefill
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.kernel_table import choose_kernels, default_kernels

MISSING = paged_prefill.unavailable_reason()
needs_kernel = pytest.mark.skipif(MISSING is not None, reason=f"prefill kernel: {MISSING}")
F32_MISSING = paged_prefill.unavailable_reason(torch.float32)
needs_f32_kernel = pytest.mark.skipif(F32_MISSING is not None,
                                      reason=f"float32 prefill kernel: {F32_MISSING}")
# Each test that is not about one path runs over both caches: (dtype, tolerance against the
# fp32 or fp64 truth).
DTYPES = [pytest.param(torch.bfloat16, 8e-3, marks=needs_kernel, id="bf16"),
          pytest.param(torch.float32, 1e-5, marks=needs_f32_kernel, id="float32")]
HEADS = [(9, 3, 64), (8, 2, 64), (4, 4, 64), (8, 2, 128), (32, 8, 128), (12, 2, 32),
         (16, 1, 64)]


def _truth(batch: Batch, seqs, qkv) -> torch.Tensor:
    """The reference path over the same stored values, in fp32 for a bf16 cache and in fp64
    for a float32 one: run after the kernel wrote the batch's K/V, so the copy holds them."""
    wide = torch.float32 if batch.dtype == torch.bfloat16 else torch.float64
    exact = Batch((batch.hq, batch.hkv, batch.dim), block_size=batch.block_size)
    exact.cache = batch.cache.to(wide)
    return exact.attend(seqs, False, tuple(t.to(wide) for t in qkv))


def _chunks(batch: Batch, shapes: list[tuple[int, int]]) -> list[tuple[int, int, list[int]]]:
    """(cached, new) per chunk -> seqs with fresh tables holding both."""
    return [(cached, new, batch.table(cached + new)) for cached, new in shapes]


DRAWS = dict(shapes=st.lists(st.tuples(st.integers(0, 900), st.integers(2, 300)), min_size=1,
                             max_size=4),
             decodes=st.lists(st.integers(1, 500), max_size=3),
             heads=st.sampled_from(HEADS), block_size=st.sampled_from([16, 32]),
             seed=st.integers(0, 2**16))


def _check_draw(dtype, shapes, decodes, heads, block_size, seed, truth_tol, reference_tol,
                tiles=True):
    """One drawn batch of chunks and decodes, each request's rows within `truth_tol` of the
    wider math and `reference_tol` of the reference path in the cache's dtype."""
    batch = Batch(heads, dtype, block_size=block_size,
                  num_blocks=7 * 1300 // block_size + 7, seed=seed)
    assert paged_prefill.usable(batch.cache, default_kernels()), \
        "the draw would compare the reference with itself"
    seqs = _chunks(batch, shapes) + batch.decodes(decodes)
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    out = batch.attend(seqs, True, qkv, tiles)
    truth = _truth(batch, seqs, qkv)
    reference = batch.attend(seqs, False, qkv)
    assert out.dtype == dtype and out.shape == truth.shape
    row = 0
    for i, (_, n, _) in enumerate(seqs):
        assert rel_err(out[row:row + n], truth[row:row + n]) < truth_tol, f"seq {i}"
        assert rel_err(out[row:row + n], reference[row:row + n]) < reference_tol, f"seq {i}"
        row += n


@needs_kernel
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tiles=st.booleans(), **DRAWS)
def test_property_chunks_match_fp32_math(shapes, decodes, heads, block_size, seed, tiles):
    """Chunks with and without a cached prefix, of any length (tails of 16-query tiles and
    32-key steps), GQA groups of 1-16, 32-128 dims, beside decodes in the same batch: within
    the output's bf16 rounding of fp32 math on the same values, and close to the bf16
    reference path. The cache is random, so the slots past a context hold arbitrary values."""
    _check_draw(torch.bfloat16, shapes, decodes, heads, block_size, seed, 8e-3, 2 ** -6, tiles)


@needs_f32_kernel
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(**DRAWS)
def test_property_float32_chunks_match_fp64_math(shapes, decodes, heads, block_size, seed):
    """The float32 path over the same draws (tails of its query tiles, 16 or 8 wide by the
    build, and of its 16-key steps): within 1e-5 of fp64 math and of the float32 reference
    path."""
    _check_draw(torch.float32, shapes, decodes, heads, block_size, seed, 1e-5, 1e-5)


@pytest.mark.parametrize("dtype,tolerance", DTYPES)
def test_a_chunk_sees_its_prefix_and_only_its_past(dtype, tolerance):
    """Each query of a chunk against dense causal attention over the request's own keys,
    the prefix written by an earlier chunk: a key one position ahead changes nothing."""
    batch = Batch((9, 3, 64), dtype, num_blocks=64)
    table = batch.table(100)
    first, second = batch.qkv(60), batch.qkv(40)
    batch.attend([(0, 60, table)], True, first)
    out = batch.attend([(60, 40, table)], True, second)
    keys = torch.cat([first[1], second[1]]).double()
    values = torch.cat([first[2], second[2]]).double()
    causal = torch.ones(40, 100, dtype=torch.bool).tril(60)
    expect = torch.nn.functional.scaled_dot_product_attention(
        second[0].double().transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1),
        attn_mask=causal, scale=0.125, enable_gqa=True).transpose(0, 1)
    assert rel_err(out, expect) < tolerance
    # The future must not leak: change the keys after the last query's position.
    batch.cache[:, table[-1], 100 % 16:] = float("nan")
    again = batch.attend([(60, 40, table)], True, second)
    assert torch.equal(again, out)


@pytest.mark.parametrize("dtype,tolerance", DTYPES)
@pytest.mark.parametrize("junk", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("block_size", [16, 32])
def test_junk_past_the_context_does_not_reach_the_output(dtype, tolerance, junk, block_size):
    """Slots past a context may hold anything a block's previous owner left, NaN and
    infinities included: neither their keys nor their values may enter the output. In
    32-token blocks the junk can fill a whole 16-token half of a block past a context."""
    batch = Batch((9, 3, 64), dtype, block_size=block_size, num_blocks=64)
    seqs = _chunks(batch, [(0, 37), (20, 5), (33, 30)])
    for cached, new, table in seqs:
        end = cached + new
        batch.cache[:, table[-1], end % block_size or block_size:] = junk
    qkv = batch.qkv(72)
    out = batch.attend(seqs, True, qkv)
    assert torch.isfinite(out).all()
    assert rel_err(out, _truth(batch, seqs, qkv)) < tolerance


@pytest.mark.parametrize("dtype,tolerance", DTYPES)
def test_the_kernel_gathers_nothing_and_builds_no_mask(monkeypatch, dtype, tolerance):
    batch = Batch((9, 3, 64), dtype)
    seqs = _chunks(batch, [(100, 50), (0, 70)])
    meta = AttentionMetadata.build(seqs, 16, "cpu", GatherWorkspace())

    def no_gather(*args, **kwargs):
        raise AssertionError("prefill gathered KV blocks")

    monkeypatch.setattr(GatherWorkspace, "gather", no_gather)
    paged_attention(*batch.qkv(120), batch.cache, meta, 0.125)
    assert meta.prefill_masks is None and meta.prefill_kernel_lens is not None


@pytest.mark.parametrize("dtype,tolerance", DTYPES)
def test_bad_arguments_raise_instead_of_reading_outside_the_cache(dtype, tolerance):
    batch = Batch((9, 3, 64), dtype, num_blocks=8)
    q = batch.qkv(20)[0]
    lens = torch.tensor([20])
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_prefill.paged_prefill(q, batch.cache, torch.tensor([[3, 99]]), lens,
                                    torch.tensor([30]), 0.125)
    with pytest.raises(RuntimeError, match="block table's capacity"):
        paged_prefill.paged_prefill(q, batch.cache, torch.tensor([[3, 4]]), lens,
                                    torch.tensor([33]), 0.125)
    with pytest.raises(RuntimeError, match="sum to 10"):
        paged_prefill.paged_prefill(q, batch.cache, torch.tensor([[3, 4]]),
                                    torch.tensor([10]), torch.tensor([30]), 0.125)
    other = torch.float32 if dtype == torch.bfloat16 else torch.bfloat16
    with pytest.raises(RuntimeError, match="of q's dtype"):
        paged_prefill.paged_prefill(q.to(other), batch.cache, torch.tensor([[3, 4]]), lens,
                                    torch.tensor([30]), 0.125)


def test_caches_the_kernel_cannot_take_keep_the_reference_path():
    """fp16 caches, 16-dim heads, 8-token blocks and the table's prefill_attention on torch:
    the chunks take the gather + SDPA path (whatever the CPU)."""
    assert "float16" in paged_prefill.unavailable_reason(torch.float16)
    for heads, dtype, block_size in (((9, 3, 64), torch.float16, 16),
                                     ((4, 2, 16), torch.bfloat16, 16),
                                     ((4, 2, 16), torch.float32, 16),
                                     ((9, 3, 64), torch.bfloat16, 8),
                                     ((9, 3, 64), torch.float32, 8)):
        batch = Batch(heads, dtype, block_size=block_size, num_blocks=40)
        assert not paged_prefill.usable(batch.cache, default_kernels())
    batch = Batch((9, 3, 64), torch.bfloat16)
    off = choose_kernels({"prefill_attention": "torch"})
    assert not paged_prefill.usable(batch.cache, off)
    meta = AttentionMetadata.build(_chunks(batch, [(10, 20)]), 16, "cpu", kernels=off)
    paged_attention(*batch.qkv(20), batch.cache, meta, 0.125)
    assert meta.prefill_kernel_lens is None and meta.prefill_masks is not None


@pytest.mark.parametrize("fixture", [pytest.param("bf16_llm", marks=needs_kernel),
                                     pytest.param("default_llm", marks=needs_f32_kernel)])
def test_engine_prefills_run_in_the_kernel_and_decode_alike(fixture, request, monkeypatch):
    """The default model in bf16 and in float32: prompts prefilled in the kernel (chunked
    and whole) give the same greedy tokens as the reference path."""
    from stallfree import SamplingParams
    from stallfree.model import attention

    llm = request.getfixturevalue(fixture)
    calls = []
    real = attention.prefill_kernel.paged_prefill
    monkeypatch.setattr(attention.prefill_kernel, "paged_prefill",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = ["The capital of France is", "def fibonacci(n):\n    " * 20]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    # The Python layers call the wrapper counted here; the C++ layer loop calls the same op
    # behind it (test_layer_loop.py holds the two paths to the same bits).
    with engine_kernels(llm, {"layer_loop": "python"}):
        fast = [o.token_ids for o in llm.generate(prompts, params)]
    assert calls, "the engine's prefills did not run in the kernel"
    assert [o.token_ids for o in llm.generate(prompts, params)] == fast
    with engine_kernels(llm, {"prefill_attention": "torch"}):
        reference = [o.token_ids for o in llm.generate(prompts, params)]
    assert fast == reference


@pytest.mark.parametrize("dtype", [pytest.param(torch.bfloat16, marks=needs_kernel, id="bf16"),
                                   pytest.param(torch.float32, marks=needs_f32_kernel,
                                                id="float32")])
def test_prefill_kernel_gives_the_same_bits_at_any_thread_count(dtype):
    """Each work item (a tile of one head's queries) runs whole on one thread, so a prefill's
    output must not change with the thread count (decode attention, which cuts a long
    context into parts per thread, is the path whose bits may)."""
    batch = Batch((9, 3, 64), dtype, block_size=16, num_blocks=200, seed=5)
    seqs = _chunks(batch, [(100, 150), (0, 64), (0, 230)])
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    threads = torch.get_num_threads()
    try:
        outs = []
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            outs.append(batch.attend(seqs, True, qkv))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
