"""How the paged-attention kernel splits a batch's decodes into groups.

The torch kernel gathers each group's KV into a dense tensor padded to the group's
longest context, so one group for the whole batch costs batch x longest context: a
loaded server with a few 1,000-token requests among many of 300 would gather three
times the KV it attends to. Grouping requests of similar length bounds that padding,
at the price of one more gather and attention call per group and layer (about as much
as gathering a couple of hundred tokens on CPU).

Pure Python without torch, so the simulator predicts the kernel with the same rule.
"""
from __future__ import annotations

# Groups split where a request's context falls below half the longest of its group (so
# padding at most doubles what a group gathers), then merge again where the merged
# padding would cost less than the extra call.
MAX_PADDING_FACTOR = 2
CALL_COST_TOKENS = 256


def decode_groups(context_lens: list[int], block_size: int) -> list[list[int]]:
    """Indices of `context_lens` in groups, each ordered longest first, groups longest first.

    Deterministic: ties keep their input order.
    """
    order = sorted(range(len(context_lens)), key=lambda i: -context_lens[i])
    blocks = [-(-c // block_size) for c in context_lens]
    groups: list[list[int]] = []
    for i in order:
        if groups and blocks[groups[-1][0]] <= MAX_PADDING_FACTOR * blocks[i]:
            groups[-1].append(i)
        else:
            groups.append([i])
    merged = groups[:1]
    for group in groups[1:]:
        padding = len(group) * (blocks[merged[-1][0]] - blocks[group[0]]) * block_size
        if padding <= CALL_COST_TOKENS:
            merged[-1].extend(group)
        else:
            merged.append(group)
    return merged


def padded_groups(context_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """(requests, longest context) of every group: what each group's call costs."""
    return [(len(g), context_lens[g[0]]) for g in decode_groups(context_lens, block_size)]
