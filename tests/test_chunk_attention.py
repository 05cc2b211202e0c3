"""A prefill chunk after a cached prefix: the split of chunk_attention.py (prefix and own
keys apart, merged by log-sum-exp) against the masked SDPA reference of attention.py."""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model import chunk_attention
from stallfree.model.attention import AttentionMetadata, paged_attention


def _run(seqs, q, k, v, cache, block_size, split: bool) -> torch.Tensor:
    meta = AttentionMetadata.build(seqs, block_size, "cpu")
    with chunk_attention.SWITCH.within(split):
        return paged_attention(q, k, v, cache.clone(), meta, 0.125)


@settings(max_examples=40, deadline=None)
@given(chunks=st.lists(st.tuples(st.integers(0, 70), st.integers(2, 40)), min_size=1,
                       max_size=3),
       decodes=st.integers(0, 3), kv_heads=st.integers(1, 2), group=st.integers(1, 3),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 999))
def test_split_prefix_attention_matches_the_masked_reference(chunks, decodes, kv_heads, group,
                                                             dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    block_size, dim, heads = 4, 16, kv_heads * group
    entries = chunks + [(int(torch.randint(1, 50, (1,), generator=gen)), 1)] * decodes
    seqs, next_block = [], 0
    for start, n in entries:  # every sequence its own blocks, in a shuffled order
        need = -(-(start + n) // block_size)
        seqs.append((start, n, list(range(next_block, next_block + need))[::-1]))
        next_block += need
    cache = torch.randn(2, next_block, block_size, kv_heads, dim, generator=gen).to(dtype)
    tokens = sum(n for _, n in entries)
    q = torch.randn(tokens, heads, dim, generator=gen).to(dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    v = torch.randn(tokens, kv_heads, dim, generator=gen).to(dtype)
    split = _run(seqs, q, k, v, cache, block_size, True)
    reference = _run(seqs, q, k, v, cache, block_size, False)
    meta = AttentionMetadata.build(seqs, block_size, "cpu")
    meta.prepare(cache)  # the split took every chunk after a cached prefix
    assert [m is None and b is not None for m, b in
            zip(meta.prefill_masks, meta.prefill_gather_blocks)] == [s > 0 for s, _ in chunks]
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(split, reference, **tol)
