"""Paged KV cache bookkeeping: which physical blocks hold which request's tokens.

Pure accounting, no tensors: the executor owns the cache memory and reads the
block tables this manager hands out. Blocks are reference counted, and with
prefix caching a full block is shared: once an iteration that wrote all its
tokens' KV has completed (`cache_computed_blocks`), it is cached under its
content key (`prefix_cache.py`), and a request admitted later with the same
tokens at the same positions shares it instead of computing it again.

A block is in exactly one of three states:

- free: no owner, no key (on the free list);
- held: `ref_count` > 0 owners (requests) have it in their tables, keyed or not;
- evictable: no owner, but keyed: its KV is still valid and a later request may
  share it; allocation takes free blocks first, then evicts these, least recently
  used first. They count as free for every capacity question (`num_free_blocks`),
  so cached blocks never starve a running request.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..request import Request
from .prefix_cache import NO_HIT, PrefixCache, PrefixCacheStats, PrefixHit, block_key


@dataclass
class Block:
    """One physical KV block; `ref_count` owners hold it; `key` once it is cached."""

    block_id: int
    ref_count: int = 0
    key: bytes | None = None

    def incref(self) -> None:
        self.ref_count += 1

    def decref(self) -> int:
        # A negative count would mean a double free: the block could then be
        # handed to two requests at once and silently corrupt both caches.
        if self.ref_count <= 0:
            raise RuntimeError(f"block {self.block_id} freed more times than it was allocated")
        self.ref_count -= 1
        return self.ref_count


class BlockManager:
    """Free list of fixed-size blocks, one block table per request, and the prefix cache."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_caching: bool = True, namespace: bytes = b"",
                 sliding_window: int | None = None) -> None:
        """`sliding_window`: where every layer of the model attends to its last
        `sliding_window` positions only, blocks that no later query can see are released
        as a request advances (`release_out_of_window`)."""
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.block_size = block_size
        self.watermark = watermark
        self.enable_caching = enable_caching
        # Blocks kept free when admitting, so running requests can still grow
        # a little before anyone must be preempted (vLLM's rule).
        self.num_watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: deque[int] = deque(range(num_blocks))  # FIFO: deterministic
        self._cache = PrefixCache(namespace)
        self._tables: dict[str, list[int]] = {}
        self._owners: dict[str, Request] = {}
        # Leading blocks of each table already offered to the cache.
        self._num_cached: dict[str, int] = {}
        self.sliding_window = sliding_window
        # What a table holds in place of a block released behind the window: the block past
        # the pool, which the executor keeps zeroed and never writes (ModelRunner.null_block).
        self.null_block = num_blocks
        self._num_released: dict[str, int] = {}  # leading table entries released

    # ---- sizes ----------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        """Blocks a request can take now: free ones plus evictable cached ones."""
        return len(self._free) + self._cache.num_evictable

    @property
    def num_evictable_blocks(self) -> int:
        """Cached blocks nobody holds (counted in num_free_blocks too)."""
        return self._cache.num_evictable

    @property
    def num_cached_blocks(self) -> int:
        """Blocks with a key, held or evictable."""
        return len(self._cache)

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (evictable cached blocks count as free)."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    @property
    def prefix_cache_stats(self) -> PrefixCacheStats:
        return self._cache.stats

    @property
    def root_key(self) -> bytes:
        """The parent key of every sequence's first block (see prefix_cache.chain_keys)."""
        return self._cache.root

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceiling division

    def most_blocks_held(self, num_tokens: int, chunk: int) -> int:
        """The most blocks a request growing to `num_tokens` cached tokens, `chunk` at most
        per iteration, holds at once: all of them, or with a sliding window those of the
        window behind its chunk and the chunk's (released ones go back as it advances)."""
        whole = self.num_blocks_for(num_tokens)
        if self.sliding_window is None:
            return whole
        return min(whole, self.num_blocks_for(self.sliding_window + chunk - 1) + 1)

    # ---- prefix cache ---------------------------------------------------------
    def _keys(self, request: Request, num_blocks: int) -> list[bytes]:
        """The keys of the request's first `num_blocks` full blocks (memoised on it)."""
        keys = request.block_hashes
        if len(keys) < num_blocks:
            bs, prompt = self.block_size, request.prompt_token_ids
            outputs = request.output_token_ids
            parent = keys[-1] if keys else self._cache.root
            for i in range(len(keys), num_blocks):
                start, end = i * bs, (i + 1) * bs
                if end <= len(prompt):
                    tokens = prompt[start:end]
                else:  # the block reaches into the outputs (a preempted request)
                    tokens = prompt[start:] + outputs[max(0, start - len(prompt)):end - len(prompt)]
                parent = block_key(parent, tokens)
                keys.append(parent)
        return keys

    def find_cached_prefix(self, request: Request) -> PrefixHit:
        """The longest chain of cached full blocks matching the start of a request that holds
        no blocks. It always leaves at least one token to compute, so logits exist."""
        # A request asking for its prompt's logprobs computes every prompt position: a
        # cached block holds keys and values, not the logits those positions need. It
        # still caches its own blocks for later requests.
        if (not self.enable_caching or request.request_id in self._tables
                or request.wants_prompt_logprobs):
            return NO_HIT
        max_blocks = (request.num_tokens - 1) // self.block_size
        block_ids: list[int] = []
        for key in self._keys(request, max_blocks)[:max_blocks]:
            block_id = self._cache.lookup(key)
            if block_id is None:
                break  # a chain: nothing after the first miss can match
            block_ids.append(block_id)
        if not block_ids:
            return NO_HIT
        return PrefixHit(tuple(block_ids), len(block_ids) * self.block_size)

    def cache_computed_blocks(self, request: Request) -> None:
        """Caches the request's full blocks whose every token's KV is now written.

        Call only once an iteration that computed them has completed (with a
        pipeline, once its micro-batch left the last stage): a block filled only
        partly, or one still being written, must never be shared.
        """
        if not self.enable_caching:
            return
        rid = request.request_id
        table = self._tables.get(rid)
        if table is None:
            return
        full = min(request.num_computed_tokens // self.block_size, len(table))
        done = self._num_cached[rid]
        if full <= done:
            return
        keys = self._keys(request, full)
        for i in range(done, full):
            block = self.blocks[table[i]]
            # A block that already has a key was shared from the cache. If another block
            # holds this key (two requests computed the same tokens at once), this one
            # stays uncached: no two blocks share a key.
            if block.key is None and self._cache.register(keys[i], block.block_id):
                block.key = keys[i]
        self._num_cached[rid] = full

    def reset_prefix_cache(self) -> int:
        """Forgets every cached block (held blocks stay with their owners, uncached);
        returns how many blocks were cached."""
        count = len(self._cache)
        for _, block_id in self._cache.items():
            self.blocks[block_id].key = None
        self._free.extend(self._cache.clear())
        return count

    # ---- allocation -----------------------------------------------------------
    def _num_missing_blocks(self, request: Request, num_new_tokens: int, hit: PrefixHit) -> int:
        held = len(self._tables.get(request.request_id, ())) + len(hit.block_ids)
        needed = self.num_blocks_for(request.num_computed_tokens + hit.num_tokens
                                     + num_new_tokens)
        return max(0, needed - held)

    def _num_revived(self, hit: PrefixHit) -> int:
        """Evictable blocks of a hit: sharing them takes them off the free count."""
        return sum(1 for b in hit.block_ids if self.blocks[b].ref_count == 0)

    def can_allocate(self, request: Request, num_new_tokens: int, use_watermark: bool,
                     hit: PrefixHit = NO_HIT) -> bool:
        """Whether the cache can hold the request's computed tokens, then `hit`'s cached
        ones (only for a request that holds no blocks), then `num_new_tokens` more."""
        taken = self._num_missing_blocks(request, num_new_tokens, hit) + self._num_revived(hit)
        reserve = self.num_watermark_blocks if use_watermark else 0
        return self.num_free_blocks - taken >= reserve

    def allocate(self, request: Request, num_new_tokens: int,
                 hit: PrefixHit | None = None) -> None:
        """Grows the request's table to hold num_computed_tokens + num_new_tokens tokens.

        `hit` is given on admission (a request holding no blocks, none computed): its
        cached blocks start the table, shared, and `num_new_tokens` follow them; the
        caller then sets num_computed_tokens to hit.num_tokens. Admissions are what the
        prefix cache statistics count.
        """
        rid = request.request_id
        admission = hit is not None
        if admission and (rid in self._tables or request.num_computed_tokens):
            raise RuntimeError(f"request {rid!r} is admitted but already holds KV")
        hit = hit or NO_HIT
        missing = self._num_missing_blocks(request, num_new_tokens, hit)
        taken = missing + self._num_revived(hit)
        if taken > self.num_free_blocks:
            raise RuntimeError(f"request {rid!r} needs {taken} more KV blocks, "
                               f"only {self.num_free_blocks} are free")
        if admission and self.enable_caching:
            stats = self._cache.stats
            stats.admissions += 1
            stats.queries += request.num_tokens
            stats.hits += hit.num_tokens
        if missing == 0 and not hit.block_ids:
            return  # never leave an empty table behind
        table = self._tables.setdefault(rid, [])
        self._owners[rid] = request
        self._num_cached.setdefault(rid, len(hit.block_ids))
        # Shared blocks first: taking new ones may evict, and must not evict these.
        for block_id in hit.block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                self._cache.revive(block_id)
            block.incref()
            table.append(block_id)
        for _ in range(missing):
            table.append(self._take_block())

    def _take_block(self) -> int:
        if self._free:
            block = self.blocks[self._free.popleft()]
        else:
            block = self.blocks[self._cache.pop_lru()]
            self._cache.drop(block.key)
            block.key = None
        block.incref()
        return block.block_id

    def free(self, request: Request) -> None:
        """Releases all of the request's blocks; a no-op if it holds none. Its cached
        blocks stay cached (evictable); the rest return to the free list."""
        rid = request.request_id
        table = self._tables.pop(rid, None)
        if table is None:
            return
        del self._owners[rid], self._num_cached[rid]
        released = self._num_released.pop(rid, 0)
        # Tail first: the head of a sequence, shared by the most requests, is evicted last.
        for block_id in reversed(table[released:]):
            self._release(block_id)

    def _release(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.decref() == 0:
            if block.key is not None:
                self._cache.park(block_id)
            else:
                self._free.append(block_id)

    def release_out_of_window(self, request: Request) -> None:
        """With a sliding window, gives back the request's leading blocks whose every token is
        out of reach of its next query (position num_computed_tokens sees only the window
        before it). Call after `cache_computed_blocks`: a full computed block is cached
        first, so a later request with the same prefix may still share it."""
        rid = request.request_id
        table = self._tables.get(rid)
        if self.sliding_window is None or table is None:
            return
        first_seen = request.num_computed_tokens - self.sliding_window + 1
        end = min(max(first_seen, 0) // self.block_size, len(table) - 1)
        done = self._num_released.get(rid, 0)
        for i in range(done, end):
            self._release(table[i])
            table[i] = self.null_block
        self._num_released[rid] = max(done, end)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds no blocks)."""
        return list(self._tables.get(request_id, ()))

    # ---- checking -------------------------------------------------------------
    def lists_holding(self, block_id: int) -> list[str]:
        """Which of the free and evictable lists hold the block (for checks; O(blocks))."""
        return ([name for name, ids in (("free", self._free),
                                        ("evictable", self._cache.evictable()))
                 if block_id in ids])

    def check_invariants(self) -> None:
        """Raises AssertionError unless free, held and evictable blocks partition the cache,
        every reference is counted, and every key is consistent."""
        free = list(self._free)
        evictable = self._cache.evictable()
        assert len(free) == len(set(free)), "a block is on the free list twice"
        owners = [0] * self.num_total_blocks
        for request_id, table in self._tables.items():
            released = self._num_released.get(request_id, 0)
            assert table[:released] == [self.null_block] * released, \
                f"request {request_id!r} holds a block behind its window"
            table = table[released:]
            assert table, f"request {request_id!r} has an empty block table"
            assert len(table) == len(set(table)), f"request {request_id!r} holds a block twice"
            for block_id in table:
                owners[block_id] += 1
        free_set, evictable_set = set(free), set(evictable)
        assert not free_set & evictable_set, "a block is both free and evictable"
        keyed = dict(self._cache.items())
        assert len(set(keyed.values())) == len(keyed), "two keys name one block"
        for block in self.blocks:
            bid = block.block_id
            assert block.ref_count >= 0, f"block {bid} has a negative ref count"
            assert block.ref_count == owners[bid], (
                f"block {bid}: ref count {block.ref_count}, held by {owners[bid]} tables")
            in_use = block.ref_count > 0
            idle = (bid in free_set) or (bid in evictable_set)
            assert in_use != idle, f"block {bid} is {'both' if in_use else 'neither'} " \
                                   f"free and in use"
            if block.key is not None:
                assert keyed.get(block.key) == bid, f"block {bid}'s key is not in the cache"
                assert bid not in free_set, f"cached block {bid} is on the free list"
            else:
                assert bid not in evictable_set, f"uncached block {bid} is evictable"
        for key, bid in keyed.items():
            assert self.blocks[bid].key == key, f"the cache names block {bid} by another key"
        # A cached block in a table sits at the position its key names.
        for request_id, table in self._tables.items():
            keys = self._owners[request_id].block_hashes
            for i, bid in enumerate(table):
                if bid == self.null_block:
                    continue
                key = self.blocks[bid].key
                if key is not None:
                    assert i < len(keys) and keys[i] == key, (
                        f"request {request_id!r} holds cached block {bid} at position {i}, "
                        f"whose tokens have another key")
