"""Sliding-window attention and soft-capped scores in `paged_attention`, on every path:
the CPU kernels (AMX tiles where the CPU has them, and their vectors) and the torch path
(gather + SDPA, or the float32 math where scores are capped), each against a naive dense
truth in float64 (`Batch.dense`: every score formed, capped, masked, softmaxed), and
the semantics against transformers' own sliding-window mask and eager Gemma 2 attention.

Chunks without and with a cached prefix whose first queries see past the window's start,
chunks shorter than the window after a longer prefix, decodes shorter and longer than the
window, GQA groups of 2, head sizes 32 and 64, 16-token blocks.
"""
from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from attention_batch import Batch, attention_kernels, rel_err
from stallfree.model import paged_prefill
from stallfree.model.attention import AttentionMetadata, GatherWorkspace, paged_attention
from stallfree.model.kernels import unavailable_reason
from stallfree.model.paged_decode import AUTO_SPLIT, paged_decode

KERNELS = unavailable_reason()
BF16_PREFILL = paged_prefill.unavailable_reason(torch.bfloat16)
needs_kernels = pytest.mark.skipif(KERNELS is not None, reason=f"kernels: {KERNELS}")
# The paths: the engine's table (AMX tiles where the CPU has them), the kernels' vectors, torch.
PATHS = [pytest.param("tiles", marks=needs_kernels), pytest.param("vectors", marks=needs_kernels),
         "torch"]
# (dtype, tolerance against the float64 truth on the same stored values): bf16 rounds the
# output and, in the prefill kernel, the weights.
DTYPES = [pytest.param(torch.float32, 1e-5, id="float32"),
          pytest.param(torch.bfloat16, 8e-3, id="bf16")]
HEADS = [(4, 2, 32), (8, 4, 64)]
# (cached, new) prefill chunks: a whole prompt longer than the window, a chunk whose first
# queries see keys before it, a short chunk after a long prefix, a two-token chunk.
CHUNKS = [(0, 70), (50, 40), (300, 17), (20, 2)]
DECODES = [1, 5, 30, 37, 38, 200, 600]  # shorter than, at and past the windows below
CAP = 2.0  # bites: the scores here have a standard deviation of about 1


def _skip_unrunnable(path: str, dtype: torch.dtype) -> None:
    if path != "torch" and dtype == torch.bfloat16 and BF16_PREFILL is not None:
        pytest.skip(f"bf16 prefill kernel: {BF16_PREFILL}")


def _meta(batch: Batch, seqs, path: str) -> AttentionMetadata:
    return AttentionMetadata.build(seqs, batch.block_size, "cpu", GatherWorkspace(),
                                   kernels=attention_kernels(path != "torch", path == "tiles"))


def _attend(batch: Batch, seqs, qkv, meta: AttentionMetadata, window: int | None,
            softcap: float | None, written: bool = False) -> torch.Tensor:
    return paged_attention(*qkv, batch.cache, meta, batch.dim ** -0.5, written, window=window,
                           softcap=softcap)


def _seqs(batch: Batch, chunks=CHUNKS, decodes=DECODES):
    return [(c, n, batch.table(c + n)) for c, n in chunks] + batch.decodes(decodes)


def _check_rows(out: torch.Tensor, truth: torch.Tensor, seqs, tolerance: float) -> None:
    """Each request's rows on their own, not only the batch's largest values."""
    assert torch.isfinite(out).all()
    row = 0
    for start, n, _ in seqs:
        err = rel_err(out[row:row + n], truth[row:row + n])
        assert err < tolerance, f"request at {start} with {n} new tokens: {err:.2e}"
        row += n


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype,tolerance", DTYPES)
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: "q{}_kv{}_d{}".format(*h))
@pytest.mark.parametrize("window,softcap", [(1, None), (16, None), (37, None), (100, None),
                                            (None, CAP), (37, CAP), (16, 30.0)])
def test_chunks_and_decodes_match_the_dense_truth(path, dtype, tolerance, heads, window,
                                                  softcap):
    _skip_unrunnable(path, dtype)
    batch = Batch(heads, dtype)
    seqs = _seqs(batch)
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    meta = _meta(batch, seqs, path)
    out = _attend(batch, seqs, qkv, meta, window, softcap)
    # The path asked for is the one that ran: the kernels build no torch plan.
    assert (meta.prefill_kernel_lens is None) == (path == "torch")
    assert bool(meta.torch_plans) == (path == "torch")
    _check_rows(out, batch.dense(seqs, qkv[0], window, softcap), seqs, tolerance)


@pytest.mark.parametrize("path", PATHS)
def test_one_batch_serves_layers_of_different_windows(path):
    """Gemma's layers alternate a window and full attention over one batch's metadata: each
    call gets its own window's masks, built once (the later layers reuse them)."""
    batch = Batch((4, 2, 32))
    seqs = _seqs(batch)
    meta = _meta(batch, seqs, path)
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    first, truth = {}, {}
    for layer, window in enumerate((37, None, 16, 37, None, 16)):
        out = _attend(batch, seqs, qkv, meta, window, None, written=layer > 0)
        if window not in truth:  # from the cache the first call wrote
            truth[window] = batch.dense(seqs, qkv[0], window)
        _check_rows(out, truth[window], seqs, 1e-5)
        if path == "torch":
            plan = first.setdefault(window, meta.torch_plans[window])
            assert meta.torch_plans[window] is plan  # not rebuilt by a later layer
    assert set(meta.torch_plans) == ({16, 37, None} if path == "torch" else set())


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("softcap", [None, CAP])
def test_a_window_longer_than_every_context_is_full_attention_to_the_bit(path, softcap):
    batch = Batch((8, 4, 64))
    seqs = _seqs(batch)
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    meta = _meta(batch, seqs, path)
    full = _attend(batch, seqs, qkv, meta, None, softcap)
    longest = max(c + n for c, n, _ in seqs)
    for window in (longest, longest + 1, 1 << 20):
        assert torch.equal(_attend(batch, seqs, qkv, meta, window, softcap, True), full)
    assert set(meta.torch_plans) <= {None}  # they share full attention's plan
    shorter = _attend(batch, seqs, qkv, meta, longest - 1, softcap, True)
    assert not torch.equal(shorter, full)  # the longest decode's first key drops out


def test_the_torch_path_gathers_only_the_windows_blocks():
    batch = Batch((4, 2, 32))
    seqs = _seqs(batch, chunks=[(300, 17), (0, 70)], decodes=[600, 5])
    meta = _meta(batch, seqs, "torch")
    _attend(batch, seqs, batch.qkv(89), meta, 37, None)
    plan = meta.torch_plans[37]
    # Chunk at 300: its first query sees keys from 264 (block 16) to 316 (block 19).
    assert plan.prefill_blocks[0].shape == (4,) and plan.prefill_masks[0].shape == (17, 317 - 256)
    # A whole prompt attends to its own K/V under a banded mask.
    assert plan.prefill_blocks[1] is None and plan.prefill_masks[1].shape == (70, 70)
    # The 600-token decode's keys 563-599 lie in blocks 35-37.
    assert sum(blocks.shape[1] for _, blocks, _ in plan.decode) <= 3 + 1


@needs_kernels
@pytest.mark.parametrize("threads", [1, 2, 3])
@pytest.mark.parametrize("split", [0, 16, 48, 256, AUTO_SPLIT])
@pytest.mark.parametrize("window", [37, 100, 129])
def test_decode_work_cut_into_parts_starts_at_each_window(threads, split, window):
    """The decode kernel's work items begin at each request's window, wherever its parts
    are cut (the AMX path's tiles stay within a block)."""
    batch = Batch((4, 2, 64), torch.bfloat16)
    contexts = [3, 700, 40, 1500, 129, 16, 130]
    seqs = batch.decodes(contexts)
    meta = AttentionMetadata.build(seqs, 16, "cpu")
    q = batch.qkv(len(seqs))[0]
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        out = paged_decode(q, batch.cache, meta.decode_block_tables, meta.decode_context_lens,
                           batch.dim ** -0.5, split, window=window, softcap=CAP)
    finally:
        torch.set_num_threads(saved)
    _check_rows(out, batch.dense(seqs, q, window, CAP), seqs, 8e-3)


@needs_kernels
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(shapes=st.lists(st.tuples(st.integers(0, 400), st.integers(2, 120)), min_size=1,
                       max_size=3),
       decodes=st.lists(st.integers(1, 400), max_size=3), window=st.integers(1, 300),
       softcap=st.sampled_from([None, CAP, 50.0]), seed=st.integers(0, 2**16))
def test_drawn_batches_match_the_truth_in_the_kernels_and_torch(shapes, decodes, window,
                                                                softcap, seed):
    batch = Batch((4, 2, 32), num_blocks=200, seed=seed)
    seqs = _seqs(batch, chunks=shapes, decodes=decodes)
    qkv = batch.qkv(sum(n for _, n, _ in seqs))
    truth = None
    for path in ("vectors", "torch"):
        out = _attend(batch, seqs, qkv, _meta(batch, seqs, path), window, softcap)
        truth = batch.dense(seqs, qkv[0], window, softcap) if truth is None else truth
        _check_rows(out, truth, seqs, 1e-5)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("cached", [0, 40])
def test_transformers_sliding_window_and_gemma2_capping_agree(path, cached):
    """transformers' sliding-window mask (kv_idx > q_idx - window) and Gemma 2's eager
    attention (scores capped before the mask), on one chunk at positions cached..."""
    masking = pytest.importorskip("transformers.masking_utils")
    gemma2 = pytest.importorskip("transformers.models.gemma2.modeling_gemma2")
    window, new, (hq, hkv, dim) = 24, 50, (8, 4, 32)
    batch = Batch((hq, hkv, dim))
    seqs = [(cached, new, batch.table(cached + new))]
    qkv = batch.qkv(new)
    out = _attend(batch, seqs, qkv, _meta(batch, seqs, path), window, 50.0)
    ctx = cached + new
    slots = [seqs[0][2][p // 16] * 16 + p % 16 for p in range(ctx)]
    k, v = (kv.reshape(-1, hkv, dim)[slots].transpose(0, 1)[None] for kv in batch.cache)
    seen = masking.sliding_window_causal_mask_function(window)(
        torch.tensor(0), torch.tensor(0), torch.arange(cached, ctx)[:, None],
        torch.arange(ctx)[None, :])
    mask = torch.zeros(seen.shape).masked_fill(~seen, float("-inf"))[None, None]
    module = torch.nn.Module()
    module.num_key_value_groups = hq // hkv
    ref, _ = gemma2.eager_attention_forward(module, qkv[0].transpose(0, 1)[None], k, v, mask,
                                            scaling=dim ** -0.5, softcap=50.0)
    assert rel_err(out, ref[0]) < 1e-5


def test_bad_windows_and_caps_raise():
    batch = Batch((4, 2, 32), num_blocks=8)
    seqs = batch.decodes([20])
    for window, softcap in ((0, None), (-3, None), (True, None), (2.5, None), (None, 0.0),
                            (None, -1.0)):
        with pytest.raises(ValueError, match="window|softcap"):
            _attend(batch, seqs, batch.qkv(1), _meta(batch, seqs, "torch"), window, softcap)
