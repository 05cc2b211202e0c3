"""Workloads that repeat themselves, as chat traffic does: multi-turn conversations.

Turn k of a conversation sends the whole history: turn k-1's prompt, its reply and a
new user message. The message and the reply take one trace row's lengths (prompt and
output); the reply the history carries is the workload's own random tokens of the reply's
length, not what the server generated, so that the workload is fixed in advance and the
same on every server (and in the simulator). A server with prefix caching then finds the
previous turn's prompt cached, up to its last full block; the reply it generated itself
does not match, so hits are a little lower than in a real chat, never higher.
"""
from __future__ import annotations

from collections.abc import Callable

Turn = tuple[list[int], int]  # (prompt token ids, output length)


def conversations(lengths: list[tuple[int, int]], turns: int, shared: list[int],
                  draw: Callable[[int], list[int]],
                  max_model_len: int | None = None) -> list[list[Turn]]:
    """Groups (message, reply) lengths into conversations of `turns` turns (the last may be
    shorter); every first prompt starts with `shared`. `draw(n)` gives n token ids. A
    conversation ends before a turn whose prompt and reply would exceed `max_model_len`
    (as a chat client must start a new one)."""
    sessions = []
    for first in range(0, len(lengths), turns):
        history = list(shared)
        session: list[Turn] = []
        for message_len, reply_len in lengths[first:first + turns]:
            prompt = history + draw(message_len)
            if max_model_len is not None and len(prompt) + reply_len > max_model_len:
                break
            session.append((prompt, reply_len))
            history = prompt + draw(reply_len)
        sessions.append(session)
    return sessions
