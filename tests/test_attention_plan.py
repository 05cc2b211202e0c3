"""The rule that splits a decode batch into length groups (pure Python, shared with the
simulator)."""
from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from stallfree.attention_plan import (
    CALL_COST_TOKENS,
    MAX_PADDING_FACTOR,
    decode_groups,
    max_call_tokens,
    padded_groups,
)

BS = 16


def _blocks(c: int) -> int:
    return -(-c // BS)


def test_one_group_for_similar_lengths():
    assert decode_groups([300, 310, 290, 301], BS) == [[1, 3, 0, 2]]
    assert padded_groups([300, 310, 290, 301], BS) == [(4, 310)]


def test_long_and_short_requests_split_and_tiny_groups_merge():
    lens = [1015, 300, 990, 40, 40, 40, 40, 100]
    groups = decode_groups(lens, BS)
    # 100 tokens under 300: apart by the factor, but one request's padding is cheaper
    # than a call; the four 40s together would pad 4 x 256 tokens, so they stay apart.
    assert groups == [[0, 2], [1, 7], [3, 4, 5, 6]]
    assert padded_groups(lens, BS) == [(2, 1015), (2, 300), (4, 40)]
    assert decode_groups([], BS) == []


def test_calls_gather_at_most_the_byte_cap():
    fp32_smollm2 = 2 * 3 * 64 * 4  # one layer's K+V of a token
    assert max_call_tokens(fp32_smollm2) == 2730 and max_call_tokens(0) is None
    # 500 tokens take 32 blocks (512 tokens): 5 requests per call.
    assert [len(g) for g in decode_groups([500] * 22, BS, fp32_smollm2)] == [5, 5, 5, 5, 2]
    assert decode_groups([500] * 22, BS) == [list(range(22))]  # no cap given
    assert decode_groups([20000, 5], BS, fp32_smollm2) == [[0], [1]]  # alone over the cap


@given(st.lists(st.integers(1, 4096), max_size=80), st.sampled_from([0, 1536, 12288]))
def test_groups_partition_the_batch_and_bound_padding(lens, kv_bytes):
    groups = decode_groups(lens, BS, kv_bytes)
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    flat = [lens[i] for g in groups for i in g]
    assert flat == sorted(lens, reverse=True)
    assert decode_groups(lens, BS, kv_bytes) == groups  # deterministic
    cap = max_call_tokens(kv_bytes)
    assert cap is None or all(len(g) == 1 or len(g) * _blocks(lens[g[0]]) * BS <= cap
                              for g in groups)
    # Padding past the factor only where merging was cheaper than a call; summed over the
    # batch it stays within those merges.
    padded = sum(len(g) * _blocks(lens[g[0]]) for g in groups) * BS
    useful = sum(_blocks(c) for c in lens) * BS
    assert padded <= MAX_PADDING_FACTOR * useful + CALL_COST_TOKENS * len(lens)


def test_the_kernel_caps_calls_on_cpu_only():
    import torch

    from stallfree.model.attention import call_cap_bytes_per_token

    fp32 = torch.zeros(2, 4, 16, 3, 64)
    assert call_cap_bytes_per_token(fp32) == 2 * 3 * 64 * 4
    assert call_cap_bytes_per_token(fp32.to(torch.bfloat16)) == 2 * 3 * 64 * 2
    assert call_cap_bytes_per_token(torch.zeros(2, 4, 16, 3, 64, device="meta")) == 0
