"""Every scheduling policy under random workloads (hypothesis), with a fake executor.

`drive` (scheduler_helpers) checks, every iteration: the token budget (but for
a lone whole prefill longer than it, under the policies that cannot chunk) and
max_num_seqs; KV invariants (no leak, ref counts never negative); FCFS
admission; each policy's defining rule (POLICY_CHECKS); with prefix caching
(drawn per workload), that every chunk attends to KV written for its own tokens
by a completed iteration (KVOracle); and at the end that
every request finished exactly once with the right tokens, within a bound on
iterations.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from scheduler_helpers import POLICY_CHECKS, drive, workloads
from stallfree.config import POLICIES


def test_every_policy_has_a_check():
    assert set(POLICY_CHECKS) == set(POLICIES)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None)
@given(w=workloads)
def test_random_workloads(policy, w):
    drive(w, policy)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=40, deadline=None)
@given(w=workloads, eos=st.frozensets(st.integers(0, 9), max_size=2),
       stop_ids=st.lists(st.integers(0, 9), max_size=2),
       aborts=st.dictionaries(st.integers(0, 40), st.integers(0, 100), max_size=4))
def test_random_workloads_with_stops_and_aborts(policy, w, eos, stop_ids, aborts):
    drive(w, policy, eos, tuple(stop_ids), aborts)


@pytest.mark.parametrize("policy", POLICIES)
@settings(max_examples=20, deadline=None)
@given(extra_blocks=st.integers(1, 6), n=st.integers(2, 12), budget=st.sampled_from([4, 32]),
       prefix_caching=st.booleans())
def test_tight_cache(policy, extra_blocks, n, budget, prefix_caching):
    """Many equal requests in a cache that holds barely more than one of them:
    preemption (or, under orca, the reservation) and oversized prefills at budget 4;
    with prefix caching, their equal prompts share blocks."""
    w = dict(budget=budget, max_num_seqs=8, block_size=2, num_blocks=6 + extra_blocks,
             watermark=0.0, max_model_len=64, requests=[(0, 4, 8, 0) for _ in range(n)],
             prefix_caching=prefix_caching)
    drive(w, policy)
