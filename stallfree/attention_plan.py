"""How the paged-attention kernel splits a batch's decodes into groups.

The torch kernel gathers each group's KV into a dense tensor padded to the group's
longest context, so one group for the whole batch costs batch x longest context: a
loaded server with a few 1,000-token requests among many of 300 would gather three
times the KV it attends to. Grouping requests of similar length bounds that padding,
at the price of one more gather and attention call per group and layer (about as much
as gathering a couple of hundred tokens on CPU). A group is also cut into calls that
gather at most MAX_CALL_BYTES: a gather that fits in the CPU's last-level cache is
still there when the attention reads it back, which halves the cost per token.

Pure Python without torch, so the simulator predicts the kernel with the same rule.
"""
from __future__ import annotations

from collections.abc import Iterable

# Groups split where a request's context falls below half the longest of its group (so
# padding at most doubles what a group gathers), then merge again where the merged
# padding would cost less than the extra call.
MAX_PADDING_FACTOR = 2
CALL_COST_TOKENS = 256
# K and V gathered by one call (2,730 tokens of SmolLM2-135M's fp32 KV). On the CPU this
# was tuned on (2 MiB L2 per core, 32 MiB L3), caps of 3-6 MiB made uniform batches of
# 1K-token decodes 1.45-1.6x faster than one call; 12 MiB only 1.1-1.3x, and 1 MiB lost
# on mixed batches to the extra calls.
MAX_CALL_BYTES = 4 << 20


def attends_as_decode(num_tokens: int) -> bool:
    """Whether the kernel runs a chunk as a decode: every one-token chunk, even a prompt's.

    The scheduler's `is_prefill` is a different question (does the chunk belong to a
    prompt, for the budget's accounting); the two differ only for a prompt's chunk of one.
    """
    return num_tokens == 1


def split_chunks(chunks: Iterable[tuple[int, int]]
                 ) -> tuple[tuple[tuple[int, int], ...], tuple[int, ...]]:
    """(start, num_tokens) of each chunk -> the chunks of several tokens as (num_tokens,
    start), and the context of each one-token chunk (start + 1), since the kernel runs every
    one-token chunk as a decode, even a prompt's."""
    chunks = list(chunks)
    return (tuple((n, start) for start, n in chunks if not attends_as_decode(n)),
            tuple(start + 1 for start, n in chunks if attends_as_decode(n)))


def max_call_tokens(kv_bytes_per_token: int) -> int | None:
    """Tokens one call may gather, for K+V of `kv_bytes_per_token` per layer (0: no cap)."""
    return max(1, MAX_CALL_BYTES // kv_bytes_per_token) if kv_bytes_per_token > 0 else None


def decode_groups(context_lens: list[int], block_size: int, kv_bytes_per_token: int = 0
                  ) -> list[list[int]]:
    """Indices of `context_lens` in groups, each ordered longest first, groups longest first;
    one group per gather-and-attend call.

    `kv_bytes_per_token`: one layer's K+V bytes of a token (0: calls are not capped).
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
    cap = max_call_tokens(kv_bytes_per_token)
    if cap is None:
        return merged
    calls = []
    for group in merged:
        per_call = max(1, cap // (blocks[group[0]] * block_size))
        calls += [group[i:i + per_call] for i in range(0, len(group), per_call)]
    return calls


def padded_groups(context_lens: list[int], block_size: int, kv_bytes_per_token: int = 0
                  ) -> list[tuple[int, int]]:
    """(requests, longest context) of every call: what each one costs."""
    return [(len(g), context_lens[g[0]])
            for g in decode_groups(context_lens, block_size, kv_bytes_per_token)]
