"""BlockManager: allocation, growth, freeing, watermark, ref counts and invariants."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.request import Request
from stallfree.sampling_params import SamplingParams
from stallfree.scheduler.kv_cache import Block, BlockManager


def make_request(rid: str, num_tokens: int = 1) -> Request:
    return Request(rid, list(range(num_tokens)), SamplingParams(), arrival_time=0.0)


def test_num_blocks_for_rounds_up():
    bm = BlockManager(10, 4)
    assert [bm.num_blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


def test_allocate_grow_and_free():
    bm = BlockManager(10, 4)
    r = make_request("a", 5)
    bm.allocate(r, 5)  # 5 tokens -> 2 blocks
    assert len(bm.block_table("a")) == 2 and bm.num_free_blocks == 8
    r.num_computed_tokens = 5
    bm.allocate(r, 3)  # 8 tokens still fit in 2 blocks
    assert len(bm.block_table("a")) == 2
    r.num_computed_tokens = 8
    first = bm.block_table("a")
    bm.allocate(r, 1)  # 9 tokens -> a third block, the old ones kept in place
    table = bm.block_table("a")
    assert len(table) == 3 and table[:2] == first and len(set(table)) == 3
    assert bm.usage == pytest.approx(0.3)
    bm.check_invariants()
    bm.free(r)
    assert bm.num_free_blocks == 10 and bm.block_table("a") == [] and bm.usage == 0.0
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants()


def test_free_twice_is_a_noop_and_counts_stay_non_negative():
    bm = BlockManager(4, 2)
    r = make_request("a", 3)
    bm.allocate(r, 3)
    bm.free(r)
    bm.free(r)
    assert bm.num_free_blocks == 4
    assert all(b.ref_count == 0 for b in bm.blocks)
    bm.check_invariants()


def test_block_ref_count_never_goes_negative():
    block = Block(0)
    block.incref()
    assert block.decref() == 0
    with pytest.raises(RuntimeError, match="freed more times"):
        block.decref()
    assert block.ref_count == 0


def test_allocate_zero_new_tokens_leaves_no_empty_table():
    bm = BlockManager(4, 2)
    bm.allocate(make_request("a"), 0)
    assert bm.block_table("a") == []
    bm.check_invariants()


def test_block_table_is_a_copy():
    bm = BlockManager(4, 2)
    bm.allocate(make_request("a", 2), 2)
    bm.block_table("a").append(99)
    assert bm.block_table("a") == [0]


def test_allocate_beyond_free_blocks_raises_and_changes_nothing():
    bm = BlockManager(3, 2)
    r = make_request("a", 8)
    assert not bm.can_allocate(r, 7, use_watermark=False)
    with pytest.raises(RuntimeError, match="needs 4 more KV blocks"):
        bm.allocate(r, 7)
    assert bm.num_free_blocks == 3 and bm.block_table("a") == []
    bm.check_invariants()


def test_watermark_keeps_blocks_free_on_admission_only():
    bm = BlockManager(100, 1, watermark=0.05)
    assert bm.num_watermark_blocks == 5
    r = make_request("a", 100)
    assert bm.can_allocate(r, 95, use_watermark=True)
    assert not bm.can_allocate(r, 96, use_watermark=True)
    assert bm.can_allocate(r, 96, use_watermark=False)
    assert bm.can_allocate(r, 100, use_watermark=False)
    assert not bm.can_allocate(r, 101, use_watermark=False)


def test_can_allocate_counts_blocks_already_held():
    bm = BlockManager(4, 4)
    r = make_request("a", 16)
    bm.allocate(r, 8)
    r.num_computed_tokens = 8
    assert bm.can_allocate(r, 8, use_watermark=False)  # 2 held + 2 free
    assert not bm.can_allocate(r, 9, use_watermark=False)


@pytest.mark.parametrize("args", [(0, 4), (4, 0), (4, 4, 1.0), (4, 4, -0.1), (2.5, 4)])
def test_constructor_rejects_bad_sizes(args):
    with pytest.raises(ValueError):
        BlockManager(*args)


def test_check_invariants_catches_corruption():
    bm = BlockManager(4, 2)
    bm.allocate(make_request("a", 2), 2)
    bm._free.append(bm.block_table("a")[0])  # a held block also on the free list
    with pytest.raises(AssertionError):
        bm.check_invariants()
    bm2 = BlockManager(4, 2)
    bm2.blocks[0].ref_count = 1  # counted but owned by nobody
    with pytest.raises(AssertionError):
        bm2.check_invariants()


@settings(max_examples=60, deadline=None)
@given(num_blocks=st.integers(1, 24), block_size=st.integers(1, 5),
       ops=st.lists(st.tuples(st.sampled_from(["grow", "free"]), st.integers(0, 4),
                              st.integers(1, 12)), max_size=60))
def test_random_allocations_never_leak(num_blocks, block_size, ops):
    bm = BlockManager(num_blocks, block_size)
    requests = {i: make_request(str(i), 1000) for i in range(5)}
    for op, i, n in ops:
        r = requests[i]
        if op == "free":
            bm.free(r)
            r.num_computed_tokens = 0
        elif bm.can_allocate(r, n, use_watermark=False):
            bm.allocate(r, n)
            r.num_computed_tokens += n
            assert len(bm.block_table(r.request_id)) == bm.num_blocks_for(r.num_computed_tokens)
        else:
            before = bm.num_free_blocks
            with pytest.raises(RuntimeError):
                bm.allocate(r, n)
            assert bm.num_free_blocks == before
        bm.check_invariants()
        held = sum(len(bm.block_table(str(j))) for j in requests)
        assert bm.num_free_blocks + held == num_blocks
    for r in requests.values():
        bm.free(r)
    assert bm.num_free_blocks == num_blocks
    bm.check_invariants()


@pytest.mark.parametrize("caching", [True, False])
def test_sliding_window_releases_blocks_behind_it(caching):
    """Window 6, blocks of 4: once 16 tokens are computed the next query (position 16) sees
    positions 11..16, so blocks 0 and 1 (positions 0..7) go back, and their table entries
    name the null block past the pool; with caching they stay shareable (evictable)."""
    bm = BlockManager(10, 4, enable_caching=caching, sliding_window=6)
    r = make_request("a", 20)
    bm.allocate(r, 12)
    r.num_computed_tokens = 12
    bm.cache_computed_blocks(r)
    bm.release_out_of_window(r)  # position 12 sees 7..12: block 0 (0..3) only
    assert bm.block_table("a")[0] == bm.null_block == 10
    assert bm.num_free_blocks == 8
    bm.allocate(r, 4)
    r.num_computed_tokens = 16
    bm.cache_computed_blocks(r)
    bm.release_out_of_window(r)
    table = bm.block_table("a")
    assert table[:2] == [10, 10] and 10 not in table[2:] and len(table) == 4
    assert bm.num_free_blocks == 8 and bm.num_evictable_blocks == (2 if caching else 0)
    bm.check_invariants()
    bm.free(r)
    assert bm.num_free_blocks == 10
    bm.check_invariants()


def test_no_window_releases_nothing():
    bm = BlockManager(10, 4)
    r = make_request("a", 20)
    bm.allocate(r, 20)
    r.num_computed_tokens = 20
    bm.release_out_of_window(r)
    assert bm.null_block not in bm.block_table("a")
