"""The CPU decode kernel (stallfree/model/paged_decode.py) against the torch reference path.

Every case runs the same batch through `paged_attention` twice, with the kernel and with
the gather + SDPA path it replaces, over one cache whose blocks are handed out in random
order. Without a built kernel (no compiler) the tests that run it skip, saying why.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_batch import Batch, rel_err
from kernel_paths import engine_kernels
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.kernel_table import choose_kernels, default_kernels
from stallfree.model.kernels import (
    KernelLibrary,
    amx_unavailable_reason,
    library_path,
    unavailable_reason,
)
from stallfree.model.paged_decode import AUTO_SPLIT, paged_decode, usable

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernel not built: {REASON}")
FP32_TOL = 1e-5
GROUPS = [(9, 3, 64), (8, 2, 64), (4, 4, 64), (8, 2, 128), (4, 2, 16)]


@needs_kernel
@pytest.mark.parametrize("heads", GROUPS, ids=lambda h: "q{}_kv{}_d{}".format(*h))
def test_decodes_match_the_reference_from_1_to_4096_tokens(heads):
    batch = Batch(heads, num_blocks=1100)
    contexts = [1, 2, 15, 16, 17, 31, 33, 100, 511, 1000, 4096]
    out, ref = batch.both(batch.decodes(contexts))
    assert rel_err(out, ref) < FP32_TOL
    for i in range(len(contexts)):  # each row, not only the batch's largest values
        assert rel_err(out[i], ref[i]) < FP32_TOL, f"context {contexts[i]}"


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("heads", [(9, 3, 64), (4, 2, 16), (4, 2, 32), (8, 2, 128)],
                         ids=lambda h: "q{}_kv{}_d{}".format(*h))
def test_half_precision_caches_are_as_close_as_their_rounding(dtype, heads):
    """Against fp32 math on the same stored values, the kernel is off by the output's
    rounding only (2^-8 relative for bf16); the bf16 reference path rounds more on the way.
    Head sizes from 32 up hold bf16 rows as even and odd dims: every size checks that
    order is undone."""
    batch = Batch(heads, dtype)
    seqs = batch.decodes([7, 64, 300, 1200])
    qkv = batch.qkv(len(seqs))
    out = batch.attend(seqs, True, qkv)
    ref = batch.attend(seqs, False, qkv)
    exact = Batch(heads)
    exact.cache = batch.cache.float()
    truth = exact.attend(seqs, False, tuple(t.float() for t in qkv))
    assert out.dtype == dtype
    assert rel_err(out, truth) < (8e-3 if dtype == torch.bfloat16 else 1e-3)
    assert rel_err(out, ref) < (2e-2 if dtype == torch.bfloat16 else 3e-3)


@needs_kernel
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("split", [0, 16, 48, 256, AUTO_SPLIT])
def test_requests_cut_into_parts_merge_to_the_same_result(threads, split):
    batch = Batch((9, 3, 64))
    contexts = [3, 700, 40, 1500, 129, 16]
    seqs = batch.decodes(contexts)
    meta = AttentionMetadata.build(seqs, 16, "cpu")
    q = batch.qkv(len(seqs))[0]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode(q, batch.cache, meta.decode_block_tables, meta.decode_context_lens,
                           0.125, split)
        whole = paged_decode(q, batch.cache, meta.decode_block_tables,
                             meta.decode_context_lens, 0.125, 0)
    finally:
        torch.set_num_threads(saved)
    assert rel_err(out, whole) < FP32_TOL
    ref = batch.attend(seqs, False, (q, *batch.qkv(len(seqs))[1:]))
    # The reference wrote new K/V into each last slot; compare rows against a fresh run.
    assert rel_err(paged_decode(q, batch.cache, meta.decode_block_tables,
                                 meta.decode_context_lens, 0.125, split), ref) < FP32_TOL


@needs_kernel
@pytest.mark.parametrize("threads", [2, 3])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_spans_per_thread_skip_requests_without_context(threads, dtype):
    # Empty requests between others, and spans that end inside one request and begin
    # inside the next: each thread's share cuts across request boundaries, at token counts
    # that are no multiple of 16 from the batch's start. In bf16 on an AMX CPU the scores
    # come in 16-token tiles, which must not straddle a block.
    batch = Batch((9, 3, 64), dtype=dtype)
    seqs = batch.decodes([50, 90, 70, 200])
    meta = AttentionMetadata.build(seqs, 16, "cpu")
    lens = meta.decode_context_lens.clone()
    lens[1] = 0
    lens = torch.cat([lens[:3], torch.zeros(1, dtype=torch.int64), lens[3:]])
    tables = torch.cat([meta.decode_block_tables[:3], meta.decode_block_tables[:1],
                        meta.decode_block_tables[3:]])
    q = batch.qkv(len(lens))[0]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        spans = paged_decode(q, batch.cache, tables, lens, 0.125, AUTO_SPLIT, tiles=True)
    finally:
        torch.set_num_threads(saved)
    whole = paged_decode(q, batch.cache, tables, lens, 0.125, 0, tiles=True)
    assert rel_err(spans, whole) < (FP32_TOL if dtype == torch.float32 else 2 ** -7)
    assert torch.count_nonzero(spans[1]) == torch.count_nonzero(spans[3]) == 0


@needs_kernel
def test_mixed_prefill_and_decode_batches_match_the_reference():
    batch = Batch((9, 3, 64))
    # Prefill chunks: one with a cached prefix of 40, one fresh; then decodes.
    first = batch.table(64)
    batch.both([(0, 40, first)])  # caches the prefix
    seqs = [(40, 24, first), (0, 33, batch.table(33))] + batch.decodes([5, 260, 1024])
    out, ref = batch.both(seqs)
    assert out.shape == ref.shape == (24 + 33 + 3, 9, 64)
    assert rel_err(out, ref) < FP32_TOL
    assert rel_err(out[57:], ref[57:]) < FP32_TOL  # the decodes on their own


@needs_kernel
def test_a_preempted_request_recomputed_in_reused_blocks():
    """A is prefilled, preempted (its blocks go to B, which overwrites them), then recomputed
    into fresh blocks; decoding both must see only their own tokens."""
    batch = Batch((9, 3, 64), num_blocks=64)
    a_prompt, b_prompt = 70, 50
    qkv_a, qkv_b = batch.qkv(a_prompt), batch.qkv(b_prompt)
    a_first = batch.table(a_prompt + 1)
    batch.attend([(0, a_prompt, a_first)], True, qkv_a)
    b_table = a_first[:4]  # preemption frees A's blocks; B takes some of them
    batch.attend([(0, b_prompt, b_table)], True, qkv_b)
    a_table = batch.table(a_prompt + 1)
    batch.attend([(0, a_prompt, a_table)], True, qkv_a)  # recompute
    q, k, v = batch.qkv(2)
    seqs = [(a_prompt, 1, a_table), (b_prompt, 1, b_table)]
    out = batch.attend(seqs, True, (q, k, v))
    ref = batch.attend(seqs, False, (q, k, v))
    assert rel_err(out, ref) < FP32_TOL
    # Ground truth: dense attention over each request's own keys.
    for row, (own, n) in enumerate(((qkv_a, a_prompt), (qkv_b, b_prompt))):
        keys = torch.cat([own[1], k[row:row + 1]])
        values = torch.cat([own[2], v[row:row + 1]])
        expect = torch.nn.functional.scaled_dot_product_attention(
            q[row][:, None], keys.transpose(0, 1), values.transpose(0, 1), scale=0.125,
            enable_gqa=True)[:, 0]
        assert rel_err(out[row], expect) < FP32_TOL, f"request {'AB'[row]} at {n} tokens"


@needs_kernel
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contexts=st.lists(st.integers(1, 700), min_size=1, max_size=12),
       heads=st.sampled_from(GROUPS), block_size=st.sampled_from([8, 16, 32]),
       seed=st.integers(0, 2**16), split=st.sampled_from([0, 16, 64, AUTO_SPLIT]))
def test_property_any_batch_matches_the_reference(contexts, heads, block_size, seed, split):
    batch = Batch(heads, block_size=block_size, num_blocks=12 * 700 // block_size + 12,
                  seed=seed)
    seqs = batch.decodes(contexts)
    q, k, v = batch.qkv(len(seqs))
    ref = batch.attend(seqs, False, (q, k, v))  # writes each row's new K/V
    meta = AttentionMetadata.build(seqs, block_size, "cpu")
    out = paged_decode(q, batch.cache, meta.decode_block_tables, meta.decode_context_lens,
                       heads[2] ** -0.5, split)
    assert rel_err(out, ref) < FP32_TOL


@needs_kernel
def test_the_kernel_gathers_nothing(monkeypatch):
    batch = Batch((9, 3, 64))
    seqs = batch.decodes([100, 900])
    meta = AttentionMetadata.build(seqs, 16, "cpu", GatherWorkspace())

    def no_gather(*args, **kwargs):
        raise AssertionError("decode gathered KV blocks")

    monkeypatch.setattr(GatherWorkspace, "gather", no_gather)
    assert usable(batch.cache, default_kernels())
    paged_attention(*batch.qkv(2), batch.cache, meta, 0.125)
    assert meta.decode_plan is None  # no length groups either


@needs_kernel
def test_bad_tables_raise_instead_of_reading_outside_the_cache():
    batch = Batch((9, 3, 64), num_blocks=8)
    q = batch.qkv(1)[0]
    with pytest.raises(RuntimeError, match="outside the cache"):
        paged_decode(q, batch.cache, torch.tensor([[3, 99]]), torch.tensor([20]), 0.125)
    with pytest.raises(RuntimeError, match="does not fit its block table"):
        paged_decode(q, batch.cache, torch.tensor([[3, 4]]), torch.tensor([33]), 0.125)


def test_without_a_built_library_the_torch_path_runs_and_says_why(tmp_path, monkeypatch,
                                                                 caplog):
    monkeypatch.setenv("STALLFREE_BUILD_DIR", str(tmp_path))
    loader = KernelLibrary()
    with caplog.at_level("WARNING", logger="stallfree.model"):
        assert not loader.load()
    assert "make kernels" in loader.reason and str(tmp_path) in loader.reason
    assert "torch path" in caplog.text
    library_path().parent.mkdir(parents=True)
    library_path().with_suffix(".error").write_text("no C++ compiler (c++) on PATH\n")
    failed = KernelLibrary()
    assert not failed.load() and "no C++ compiler" in failed.reason


def test_the_reference_path_never_uses_the_kernel():
    batch = Batch((9, 3, 64))
    assert not usable(batch.cache, choose_kernels({"decode_attention": "torch"}))
    # Other devices keep the torch path.
    assert not usable(batch.cache.to("meta"), default_kernels())


@needs_kernel
def test_engine_greedy_output_is_the_same_with_and_without_the_kernel(default_llm,
                                                                      monkeypatch):
    from stallfree import SamplingParams
    from stallfree.model import attention

    calls = []
    real = attention.paged_decode
    monkeypatch.setattr(attention, "paged_decode",
                        lambda *a, **kw: calls.append(1) or real(*a, **kw))
    prompts = ["The capital of France is", "def fibonacci(n):"]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    # The Python layers, whose attention call is seen.
    with engine_kernels(default_llm, {"layer_loop": "python"}):
        fast = [o.token_ids for o in default_llm.generate(prompts, params)]
    assert calls, "the engine's decodes did not run in the kernel"
    with engine_kernels(default_llm, {"decode_attention": "torch"}):
        reference = [o.token_ids for o in default_llm.generate(prompts, params)]
    assert fast == reference


AMX_MISSING = amx_unavailable_reason()
needs_amx = pytest.mark.skipif(AMX_MISSING is not None, reason=f"no AMX: {AMX_MISSING}")


def _decode_op(batch: Batch, seqs, q: torch.Tensor, tiles: bool, split: int = AUTO_SPLIT):
    meta = AttentionMetadata.build(seqs, batch.block_size, "cpu")
    return paged_decode(q, batch.cache, meta.decode_block_tables, meta.decode_context_lens,
                        batch.dim ** -0.5, split, tiles=tiles)


@needs_amx
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contexts=st.lists(st.integers(1, 700), min_size=1, max_size=10),
       heads=st.sampled_from([(9, 3, 64), (8, 2, 64), (4, 4, 64), (8, 2, 128), (32, 8, 128),
                              (12, 2, 32), (16, 1, 64)]),
       block_size=st.sampled_from([16, 32]), seed=st.integers(0, 2**16),
       split=st.sampled_from([0, 16, 64, AUTO_SPLIT]))
def test_property_scores_in_amx_tiles_match_fp32_math(contexts, heads, block_size, seed,
                                                      split):
    """bf16 cache: the tile path against fp32 math on the same stored values within the
    output's rounding, and against the vector path within one bf16 step. Groups of 1-16
    heads, several column tiles (32 heads), 32-128 dims, blocks of one or two tiles, the
    garbage rows past a context's end masked (a random cache, NaN-free but arbitrary)."""
    batch = Batch(heads, torch.bfloat16, block_size=block_size,
                  num_blocks=10 * 700 // block_size + 10, seed=seed)
    seqs = batch.decodes(contexts)
    q = batch.qkv(len(seqs))[0]
    tiles = _decode_op(batch, seqs, q, True, split)
    vectors = _decode_op(batch, seqs, q, False, split)
    exact = Batch(heads, block_size=block_size)
    exact.cache = batch.cache.float()
    truth = _decode_op(exact, seqs, q.float(), False, split)
    assert tiles.dtype == torch.bfloat16
    for row in range(len(seqs)):
        assert rel_err(tiles[row], truth[row]) < 8e-3, f"row {row}"
        assert rel_err(tiles[row], vectors[row]) < 2 ** -7, f"row {row}"


@needs_amx
def test_masked_tail_rows_holding_nan_do_not_reach_the_output():
    """A block's slots past the context may hold anything a previous owner left: NaN there
    must not enter the scores of the tokens that count."""
    batch = Batch((9, 3, 64), torch.bfloat16, num_blocks=64)
    seqs = batch.decodes([5, 21, 40])
    for _, _, table in seqs:
        batch.cache[:, table[-1], 8:] = float("nan")  # past every context's end (5, 21-16, 40-32)
    q = batch.qkv(len(seqs))[0]
    out = _decode_op(batch, seqs, q, True)
    assert torch.isfinite(out).all()
    assert rel_err(out, _decode_op(batch, seqs, q, False)) < 2 ** -7


@needs_kernel
def test_shapes_the_tiles_cannot_take_run_in_vectors_bit_for_bit():
    """Blocks of 8 tokens (a tile would cross blocks), 16-dim heads (half a tile), a float32
    cache and groups of more than 16 heads take the vector path whatever `tiles` says."""
    for heads, dtype, block_size in (((9, 3, 64), torch.bfloat16, 8),
                                     ((4, 2, 16), torch.bfloat16, 16),
                                     ((9, 3, 64), torch.float32, 16),
                                     ((17, 1, 64), torch.bfloat16, 16)):
        batch = Batch(heads, dtype, block_size=block_size, num_blocks=200)
        seqs = batch.decodes([3, 90, 250])
        q = batch.qkv(len(seqs))[0]
        assert torch.equal(_decode_op(batch, seqs, q, True), _decode_op(batch, seqs, q, False))
