"""Prefix caching in the scheduler (no torch): exact hits, eviction, preemption, n > 1, PP."""
from __future__ import annotations

from collections import deque

import pytest

from scheduler_helpers import (
    TOKEN,
    KVOracle,
    make_request,
    new_scheduler,
    run_until_done,
    shape,
    step,
)
from stallfree.config import POLICIES
from stallfree.request import Request
from stallfree.sampling_params import SamplingParams
from stallfree.scheduler.prefix_cache import block_key, chain_keys, root_key


def req(rid: str, tokens: list[int], max_tokens: int = 2, **params) -> Request:
    return Request(rid, list(tokens), SamplingParams(max_tokens=max_tokens, **params), 0.0)


def cached(policy: str = "sarathi", **kwargs):
    return new_scheduler(policy, prefix_caching=True, **kwargs)


def computed_prompt_tokens(sched, request: Request) -> int:
    """Runs the scheduler to the end; the tokens of `request` computed before its first sample."""
    total = 0
    for i in range(1000):
        if not sched.has_unfinished_requests():
            return total
        out, _ = step(sched, float(i))
        for c in out.chunks:
            if c.request is request and c.start < request.num_prompt_tokens:
                total += c.num_tokens
    raise AssertionError("did not finish")


# ---- keys ------------------------------------------------------------------------------
def test_keys_chain_the_parent_and_differ_by_position_and_namespace():
    root = root_key(b"model-a")
    keys = chain_keys(list(range(12)), 4, root)
    assert len(keys) == 3 and len(set(keys)) == 3
    assert keys[1] == block_key(keys[0], [4, 5, 6, 7])
    assert chain_keys(list(range(4, 8)), 4, root)[0] != keys[1]  # same tokens, other position
    assert chain_keys(list(range(12)), 4, root_key(b"model-b")) != keys
    assert chain_keys(list(range(11)), 4, root) == keys[:2]  # a partial block has no key


# ---- hits where expected -------------------------------------------------------------------
@pytest.mark.parametrize("prompt_len, hit", [(10, 8), (12, 8), (13, 12), (4, 0), (5, 4)])
def test_second_identical_prompt_computes_exactly_the_uncached_tail(prompt_len, hit):
    sched = cached(block_size=4)
    tokens = [50 + i for i in range(prompt_len)]
    first, second = req("a", tokens), req("b", tokens)
    sched.add_request(first)
    assert computed_prompt_tokens(sched, first) == prompt_len
    sched.add_request(second)
    # At least one prompt token is always computed, so whole cached prompts recompute a block.
    assert computed_prompt_tokens(sched, second) == prompt_len - hit
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, hit)
    stats = sched.block_manager.prefix_cache_stats
    assert (stats.queries, stats.hits, stats.admissions) == (2 * prompt_len, hit, 2)
    assert second.output_token_ids == [TOKEN, TOKEN]


def test_a_cache_hit_costs_no_budget_and_chunking_starts_after_it():
    sched = cached(budget=6, block_size=4)
    tokens = list(range(100, 130))
    sched.add_request(req("a", tokens, max_tokens=1))
    run_until_done(sched)
    sched.add_request(req("b", tokens + [7, 8, 9], max_tokens=1))
    shapes = [shape(step(sched)[0]) for _ in range(2)]
    assert shapes == [[("b", 28, 5)], []]  # 33 tokens, 28 cached: one chunk of 5


def test_shared_system_prompt_is_computed_once():
    sched = cached(budget=64, block_size=4, num_blocks=64)
    system = list(range(200, 232))  # 32 tokens: 8 full blocks
    questions = [[300 + 10 * q + i for i in range(3 + q)] for q in range(5)]
    first = req("q0", system + questions[0])
    sched.add_request(first)
    run_until_done(sched)
    rest = [req(f"q{q}", system + questions[q]) for q in range(1, 5)]
    for r in rest:
        sched.add_request(r)
    prompt_tokens = {r.request_id: 0 for r in rest}
    while sched.has_unfinished_requests():
        for c in step(sched)[0].chunks:
            if c.start < c.request.num_prompt_tokens:
                prompt_tokens[c.request_id] += c.num_tokens
    # Each computes only its question: the system prompt's 32 tokens come from the cache.
    assert prompt_tokens == {f"q{q}": 3 + q for q in range(1, 5)}
    assert [r.num_cached_tokens for r in rest] == [32] * 4


def test_a_hit_stops_at_the_first_differing_block():
    sched = cached(block_size=4)
    base = list(range(10, 30))  # 5 full blocks
    sched.add_request(req("a", base))
    run_until_done(sched)
    bm = sched.block_manager
    differs_in_block_2 = base[:9] + [999] + base[10:]
    assert bm.find_cached_prefix(req("b", differs_in_block_2)).num_tokens == 8
    assert bm.find_cached_prefix(req("c", [999] + base[1:])).num_tokens == 0
    # Equal blocks at other positions do not match: a key names the whole prefix.
    assert bm.find_cached_prefix(req("d", base[4:])).num_tokens == 0
    assert bm.find_cached_prefix(req("e", base + [1, 2])).num_tokens == 20


def test_a_partial_block_is_never_cached_mid_prefill():
    sched = cached(budget=6, block_size=4)
    tokens = list(range(40, 60))
    a = req("a", tokens)
    sched.add_request(a)
    step(sched)  # 6 tokens computed: block 0 full, block 1 half
    bm = sched.block_manager
    assert bm.num_cached_blocks == 1
    assert bm.find_cached_prefix(req("probe", tokens)).num_tokens == 4


# ---- eviction ------------------------------------------------------------------------
def test_cached_blocks_are_evicted_least_recently_used_first():
    sched = cached(budget=64, block_size=4, num_blocks=8, max_model_len=64)
    bm = sched.block_manager
    a, b = list(range(100, 108)), list(range(200, 208))  # two blocks each
    for rid, tokens in (("a", a), ("b", b)):
        sched.add_request(req(rid, tokens, max_tokens=1))
        run_until_done(sched)
    assert bm.num_evictable_blocks == 4 and bm.num_free_blocks == 8
    # Six blocks: the four never-cached free ones first, then a's two (freed before b's).
    sched.add_request(req("c", list(range(300, 324)), max_tokens=1))
    run_until_done(sched)
    assert bm.find_cached_prefix(req("a2", a + [1])).num_tokens == 0
    assert bm.find_cached_prefix(req("b2", b + [1])).num_tokens == 8
    bm.check_invariants()


def test_a_freed_sequence_is_evicted_tail_first():
    sched = cached(budget=64, block_size=4, num_blocks=6, max_model_len=64)
    bm = sched.block_manager
    a = list(range(100, 116))  # four blocks
    sched.add_request(req("a", a, max_tokens=1))
    run_until_done(sched)
    sched.add_request(req("c", list(range(300, 312)), max_tokens=1))  # 3 blocks: evicts 1
    run_until_done(sched)
    assert bm.find_cached_prefix(req("a2", a + [1])).num_tokens == 12  # the tail went


def test_cached_blocks_never_starve_a_running_request():
    sched = cached(budget=64, block_size=4, num_blocks=10, max_model_len=64)
    bm = sched.block_manager
    for i in range(5):  # fill the cache with evictable blocks of unrelated prompts
        sched.add_request(req(f"old{i}", [500 + 10 * i + j for j in range(8)], max_tokens=1))
    run_until_done(sched)
    assert bm.num_evictable_blocks == 10 and bm.num_free_blocks == 10
    big = req("big", list(range(900, 920)), max_tokens=20)  # grows to 39 tokens: all 10 blocks
    sched.add_request(big)
    outs = []
    while sched.has_unfinished_requests():
        outs.append(step(sched)[0])
    assert big.num_output_tokens == 20 and not any(o.preempted for o in outs)
    assert big.num_preemptions == 0


def test_after_every_request_free_plus_cached_is_all_and_reset_frees_all():
    sched = cached(budget=16, block_size=4, num_blocks=32)
    for i in range(6):
        sched.add_request(req(f"r{i}", [100 + j for j in range(5 + 3 * i)], max_tokens=4))
    run_until_done(sched)
    bm = sched.block_manager
    assert bm.num_evictable_blocks > 0 and bm.usage == 0.0
    # Nothing runs: every cached block is evictable, every other block free.
    assert bm.num_cached_blocks == bm.num_evictable_blocks
    assert bm.num_free_blocks == bm.num_total_blocks
    num_cached = bm.num_cached_blocks
    assert bm.reset_prefix_cache() == num_cached
    assert bm.num_cached_blocks == bm.num_evictable_blocks == 0
    assert bm.num_free_blocks == bm.num_total_blocks
    bm.check_invariants()


def test_reset_while_running_keeps_the_running_blocks():
    sched = cached(budget=8, block_size=4, num_blocks=16)
    a = req("a", list(range(100, 116)), max_tokens=4)
    sched.add_request(a)
    step(sched)
    step(sched)  # all 16 prompt tokens computed: 4 blocks cached, held by a
    bm = sched.block_manager
    table = bm.block_table("a")
    assert bm.num_cached_blocks == 4
    assert bm.reset_prefix_cache() == 4
    assert bm.block_table("a") == table and bm.num_cached_blocks == 0
    run_until_done(sched)
    assert a.num_output_tokens == 4 and bm.num_free_blocks == bm.num_total_blocks
    bm.check_invariants()


# ---- preemption -----------------------------------------------------------------------
def test_a_preempted_request_recomputes_mostly_from_its_cached_blocks():
    # Two requests grow until the cache is full: the newer one is preempted, and
    # readmitted after its cached full blocks (prompt and outputs alike).
    sched = cached(budget=32, block_size=4, num_blocks=10, max_model_len=64)
    a, b = make_request("a", 12, max_tokens=20), make_request("b", 13, max_tokens=20)
    b.prompt_token_ids[0] = 1  # no sharing with a
    sched.add_request(a)
    sched.add_request(b)
    admissions = []  # (start, tokens known) of b's chunks when it was waiting before them
    for i in range(200):
        if not sched.has_unfinished_requests():
            break
        was_waiting = b in sched.waiting
        out, _ = step(sched, float(i))
        admissions += [(c.start, c.request.num_tokens) for c in out.chunks
                       if c.request is b and was_waiting]
    assert b.num_preemptions > 0 and len(admissions) == 1 + b.num_preemptions
    assert a.num_output_tokens == b.num_output_tokens == 20
    assert admissions[0][0] == 0 and b.num_cached_tokens == 0
    # Readmitted after whole cached blocks of its prompt and outputs, not from 0.
    assert all(start > 0 and start % 4 == 0 for start, _ in admissions[1:])
    stats = sched.block_manager.prefix_cache_stats
    assert stats.admissions == 1 + len(admissions)
    assert stats.hits == sum(start for start, _ in admissions)


@pytest.mark.parametrize("policy", POLICIES)
def test_every_policy_admits_after_the_cached_prefix(policy):
    sched = cached(policy, budget=64, block_size=4, num_blocks=64)
    tokens = list(range(100, 120))
    sched.add_request(req("a", tokens))
    run_until_done(sched)
    b = req("b", tokens + [5, 6])
    sched.add_request(b)
    out, _ = step(sched)
    assert shape(out) == [("b", 20, 2)]
    run_until_done(sched)
    assert b.output_token_ids == [TOKEN, TOKEN]


# ---- n > 1 -----------------------------------------------------------------------------
def test_siblings_wait_for_the_leaders_prompt_then_share_it():
    sched = cached(budget=8, block_size=4)
    tokens = list(range(100, 118))  # 18 tokens: 4 full blocks shareable
    group = [req(f"g#{i}", tokens, max_tokens=3) for i in range(3)]
    sched.add_group(group)
    assert [r.request_id for r in sched.waiting] == ["g#0"] and sched.num_waiting == 3
    prompt_chunks = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        prompt_chunks += [(c.request_id, c.start, c.num_tokens) for c in out.chunks
                          if c.start < c.request.num_prompt_tokens]
    assert prompt_chunks[:3] == [("g#0", 0, 8), ("g#0", 8, 8), ("g#0", 16, 2)]
    # The siblings join once the leader's 16 shareable tokens are cached, and compute
    # only the prompt's last 2 tokens each.
    assert sorted(prompt_chunks[3:]) == [("g#1", 16, 2), ("g#2", 16, 2)]
    assert [r.num_cached_tokens for r in group] == [0, 16, 16]
    assert all(r.output_token_ids == [TOKEN] * 3 for r in group)


def test_siblings_of_an_aborted_leader_compute_the_prompt_themselves():
    sched = cached(budget=8, block_size=4)
    tokens = list(range(100, 118))
    group = [req(f"g#{i}", tokens, max_tokens=2) for i in range(3)]
    sched.add_group(group)
    step(sched)  # the leader's first chunk
    sched.abort_request("g#1")  # a held sibling
    sched.abort_request("g#0")  # the leader: g#2 is released
    assert [r.request_id for r in sched.waiting] == ["g#2"]
    run_until_done(sched)
    # The leader's first chunk (8 tokens, two blocks) stays cached after its abort.
    assert group[2].output_token_ids == [TOKEN, TOKEN] and group[2].num_cached_tokens == 8
    assert [r.finish_reason for r in group] == ["abort", "abort", "length"]


def test_groups_are_not_held_without_caching_or_for_a_short_prompt():
    sched = new_scheduler("sarathi", block_size=4)
    sched.add_group([req(f"g#{i}", list(range(20)), max_tokens=1) for i in range(2)])
    assert sched.num_waiting == len(sched.waiting) == 2
    sched = cached(block_size=4)
    sched.add_group([req(f"s#{i}", [1, 2, 3, 4], max_tokens=1) for i in range(2)])
    assert len(sched.waiting) == 2  # no full block to share
    with pytest.raises(ValueError, match="repeat"):
        sched.add_group([req("x", [1]), req("x", [1])])
    with pytest.raises(ValueError, match="already in use"):
        sched.add_group([req("y", [1]), req("s#0", [1])])
    assert "y" not in {r.request_id for r in sched.waiting}  # all or none


# ---- pipeline parallelism ---------------------------------------------------------------
def test_blocks_are_cached_only_once_their_micro_batch_completed():
    sched = cached(budget=32, block_size=4, num_blocks=32)
    tokens = list(range(100, 116))
    a = req("a", tokens, max_tokens=2)
    sched.add_request(a)
    first = sched.schedule(0.0)  # a's whole prompt, in flight
    sched.add_request(req("b", tokens, max_tokens=2))
    second = sched.schedule(1.0, frozenset({"a"}))
    assert shape(second) == [("b", 0, 16)]  # a's blocks are being written: no hit
    sched.update(first, {"a": TOKEN}, 2.0)
    assert sched.block_manager.num_cached_blocks == 4
    sched.update(second, {"b": TOKEN}, 3.0)
    # b computed the same tokens: its copies stay uncached (no two blocks share a key).
    assert sched.block_manager.num_cached_blocks == 4
    sched.block_manager.check_invariants()


@pytest.mark.parametrize("policy", POLICIES)
def test_pipelined_micro_batches_read_only_completed_kv(policy):
    sched = cached(policy, budget=16, max_num_seqs=8, num_blocks=40, block_size=2,
                   max_model_len=64)
    oracle = KVOracle(sched.block_manager)
    shared = list(range(100, 110))
    requests = [req(f"r{i}", shared[:4 + (i % 4) * 2] + [i] * (1 + i % 3), max_tokens=5)
                for i in range(10)]
    in_flight: deque = deque()
    pending = deque(requests)
    for now in range(2000):
        if pending and now % 2 == 0:
            sched.add_request(pending.popleft())
        busy = frozenset(c.request_id for out in in_flight for c in out.chunks)
        while len(in_flight) < 2:
            out = sched.schedule(float(now), busy)
            if out.is_empty:
                break
            for c in out.chunks:
                oracle.check_scheduled(c)
            in_flight.append(out)
            busy |= {c.request_id for c in out.chunks}
        if in_flight:
            out = in_flight.popleft()
            oracle.completed(out.chunks)
            sched.update(out, {c.request_id: TOKEN for c in out.chunks if c.samples},
                         float(now))
            sched.block_manager.check_invariants()
        elif not pending and not sched.has_unfinished_requests():
            break
    assert all(r.output_token_ids == [TOKEN] * 5 for r in requests)
    assert sched.block_manager.prefix_cache_stats.hits > 0
