"""SarathiScheduler under random workloads (hypothesis): its invariants hold for any input.

The driver and its checks (including sarathi's stall-free rule) live in
scheduler_helpers; test_policy_properties.py runs the same driver on every policy.
"""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_helpers import drive, workloads


@settings(max_examples=60, deadline=None)
@given(workloads)
def test_random_workloads_finish_exactly_once(w):
    drive(w)


@settings(max_examples=60, deadline=None)
@given(workloads, st.frozensets(st.integers(0, 9), max_size=2),
       st.lists(st.integers(0, 9), max_size=2),
       st.dictionaries(st.integers(0, 40), st.integers(0, 100), max_size=4))
def test_random_workloads_with_stops_and_aborts(w, eos, stop_ids, aborts):
    drive(w, eos=eos, stop_ids=tuple(stop_ids), aborts=aborts)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 6), st.integers(2, 12))
def test_tight_cache_preempts_and_still_finishes(num_blocks_extra, n):
    """Many equal requests in a cache that holds barely more than one of them."""
    w = dict(budget=32, max_num_seqs=8, block_size=2, num_blocks=6 + num_blocks_extra,
             watermark=0.0, max_model_len=64,
             requests=[(0, 4, 8, 0) for _ in range(n)])
    drive(w)
