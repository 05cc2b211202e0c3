"""Content-addressed KV blocks: the key of a full block, and the blocks cached under keys.

A full block's KV depends only on the tokens at its positions and on every token
before them (attention), so a block is named by a chain: its key hashes its
parent block's key and its own token ids. The first block's parent is the root,
a hash of whatever else changes the KV (the model, its dtype): equal keys mean
equal KV. The hash is BLAKE2b (128 bits): a collision would hand one request
another's KV, so a fast non-cryptographic hash (Python's `hash`) is not enough
when prompts come from untrusted clients.

`PrefixCache` maps keys to block ids and keeps the cached blocks nobody holds in
least-recently-freed order, evicted oldest first. Pure accounting, like the
block manager that owns it.
"""
from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass

_DIGEST_BYTES = 16


def root_key(namespace: bytes = b"") -> bytes:
    """The parent of every sequence's first block, for one model and KV layout."""
    return hashlib.blake2b(b"stallfree-kv\0" + namespace, digest_size=_DIGEST_BYTES).digest()


def block_key(parent: bytes, token_ids: Sequence[int]) -> bytes:
    """The key of a full block holding `token_ids` after the block keyed `parent`."""
    h = hashlib.blake2b(parent, digest_size=_DIGEST_BYTES)
    h.update(array("q", token_ids).tobytes())
    return h.digest()


def chain_keys(token_ids: Sequence[int], block_size: int, root: bytes) -> list[bytes]:
    """The keys of every full block of a token sequence (reference implementation)."""
    keys: list[bytes] = []
    parent = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = block_key(parent, token_ids[start:start + block_size])
        keys.append(parent)
    return keys


@dataclass(frozen=True)
class PrefixHit:
    """The cached full blocks a request can start from: its first `num_tokens` tokens."""

    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0


NO_HIT = PrefixHit()


@dataclass
class PrefixCacheStats:
    """Cumulative, in tokens, as vLLM counts them: at each admission, the tokens whose
    KV was needed (queries) and those found cached (hits)."""

    queries: int = 0
    hits: int = 0
    admissions: int = 0

    @property
    def hit_rate(self) -> float:
        return self.hits / self.queries if self.queries else 0.0


class PrefixCache:
    """Key -> block id for cached full blocks, and an LRU list of those nobody holds."""

    def __init__(self, namespace: bytes = b"") -> None:
        self.root = root_key(namespace)
        self._by_key: dict[bytes, int] = {}
        # Cached blocks with no owner, oldest first: evicted in this order.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self.stats = PrefixCacheStats()

    def __len__(self) -> int:
        return len(self._by_key)

    @property
    def num_evictable(self) -> int:
        return len(self._evictable)

    def lookup(self, key: bytes) -> int | None:
        return self._by_key.get(key)

    def register(self, key: bytes, block_id: int) -> bool:
        """Caches `block_id` under `key`; False (nothing changes) if another block has it,
        so no two blocks ever share a key."""
        if key in self._by_key:
            return False
        self._by_key[key] = block_id
        return True

    def park(self, block_id: int) -> None:
        """Its last owner let go: evictable, as the most recently used."""
        self._evictable[block_id] = None

    def revive(self, block_id: int) -> None:
        """A request shares it again: no longer evictable."""
        self._evictable.pop(block_id, None)

    def drop(self, key: bytes) -> None:
        """Forgets a key (its block was evicted)."""
        del self._by_key[key]

    def items(self) -> list[tuple[bytes, int]]:
        return list(self._by_key.items())

    def evictable(self) -> list[int]:
        """Evictable block ids, oldest first."""
        return list(self._evictable)

    def pop_lru(self) -> int:
        """The least recently used evictable block, taken off the evictable list."""
        block_id, _ = self._evictable.popitem(last=False)
        return block_id

    def clear(self) -> list[int]:
        """Forgets every key; returns the evictable blocks (now plain free blocks)."""
        freed = list(self._evictable)
        self._by_key.clear()
        self._evictable.clear()
        return freed
