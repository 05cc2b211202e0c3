"""n > 1 with prefix caching: sequences held back until their leader's prompt KV is cached.

The n sequences of one prompt would otherwise be admitted together and each compute the
prompt. Held back, they wait until the first (the leader) has computed the prompt's
shareable full blocks, then find them in the prefix cache: the prompt is prefilled once.
"""
from __future__ import annotations

from collections.abc import Sequence

from ..request import Request


class HeldSiblings:
    """Siblings waiting for their leader, by leader id."""

    def __init__(self) -> None:
        self._by_leader: dict[str, list[Request]] = {}

    def __len__(self) -> int:
        return sum(len(s) for s in self._by_leader.values())

    def hold(self, leader: Request, siblings: Sequence[Request]) -> None:
        self._by_leader[leader.request_id] = list(siblings)

    def discard(self, request: Request) -> bool:
        """Drops a held sibling (aborted); False if it is not held."""
        for siblings in self._by_leader.values():
            if request in siblings:
                siblings.remove(request)
                return True
        return False

    def release(self, leader: Request, block_size: int) -> list[Request]:
        """The leader's siblings once every full block its prompt can share is computed (its
        iteration completed), or once it finished without them (they then compute the prompt
        themselves); [] until then."""
        if leader.request_id not in self._by_leader:
            return []
        shareable = (leader.num_prompt_tokens - 1) // block_size * block_size
        if leader.is_finished or leader.num_computed_tokens >= shareable:
            return self._by_leader.pop(leader.request_id)
        return []
