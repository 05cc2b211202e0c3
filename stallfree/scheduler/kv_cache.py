"""Paged KV cache bookkeeping: which physical blocks hold which request's tokens.

Pure accounting, no tensors: the executor owns the cache memory and reads the
block tables this manager hands out. Blocks are reference counted so that a
later prefix cache can share full blocks between requests; today every block
has exactly one owner.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from ..request import Request


@dataclass
class Block:
    """One physical KV block; `ref_count` owners hold it (0 = on the free list)."""

    block_id: int
    ref_count: int = 0

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
    """Free list of fixed-size blocks plus one block table per request."""

    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be a positive integer, got {num_blocks!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
        if not 0 <= watermark < 1:
            raise ValueError(f"watermark must be in [0, 1), got {watermark!r}")
        self.block_size = block_size
        self.watermark = watermark
        # Blocks kept free when admitting, so running requests can still grow
        # a little before anyone must be preempted (vLLM's rule).
        self.num_watermark_blocks = int(watermark * num_blocks)
        self.blocks = [Block(i) for i in range(num_blocks)]
        # FIFO free list: deterministic, and recently freed blocks are reused
        # last, which a future prefix cache can exploit.
        self._free: deque[int] = deque(range(num_blocks))
        self._tables: dict[str, list[int]] = {}

    # ---- sizes ----------------------------------------------------------------
    @property
    def num_total_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks in use."""
        return 1.0 - self.num_free_blocks / self.num_total_blocks

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)  # ceiling division

    # ---- allocation -----------------------------------------------------------
    def _num_missing_blocks(self, request: Request, num_new_tokens: int) -> int:
        needed = self.num_blocks_for(request.num_computed_tokens + num_new_tokens)
        return max(0, needed - len(self._tables.get(request.request_id, ())))

    def can_allocate(self, request: Request, num_new_tokens: int, use_watermark: bool) -> bool:
        """Whether the cache can hold num_computed_tokens + num_new_tokens of `request`."""
        missing = self._num_missing_blocks(request, num_new_tokens)
        reserve = self.num_watermark_blocks if use_watermark else 0
        return self.num_free_blocks - missing >= reserve

    def allocate(self, request: Request, num_new_tokens: int) -> None:
        """Grows the request's table to hold num_computed_tokens + num_new_tokens tokens."""
        missing = self._num_missing_blocks(request, num_new_tokens)
        if missing > self.num_free_blocks:
            raise RuntimeError(f"request {request.request_id!r} needs {missing} more KV blocks, "
                               f"only {self.num_free_blocks} are free")
        if missing == 0:
            return  # never leave an empty table behind
        table = self._tables.setdefault(request.request_id, [])
        for _ in range(missing):
            block = self.blocks[self._free.popleft()]
            block.incref()
            table.append(block.block_id)

    def free(self, request: Request) -> None:
        """Releases all of the request's blocks; a no-op if it holds none."""
        table = self._tables.pop(request.request_id, None)
        if table is None:
            return
        # Tail first: the head of a sequence is the part worth keeping longest
        # once blocks can be shared by prefix.
        for block_id in reversed(table):
            if self.blocks[block_id].decref() == 0:
                self._free.append(block_id)

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block table ([] if it holds no blocks)."""
        return list(self._tables.get(request_id, ()))

    # ---- checking -------------------------------------------------------------
    def check_invariants(self) -> None:
        """Raises AssertionError unless free and allocated blocks partition the cache."""
        free = list(self._free)
        assert len(free) == len(set(free)), "a block is on the free list twice"
        owners = [0] * self.num_total_blocks
        for request_id, table in self._tables.items():
            assert table, f"request {request_id!r} has an empty block table"
            assert len(table) == len(set(table)), f"request {request_id!r} holds a block twice"
            for block_id in table:
                owners[block_id] += 1
        free_set = set(free)
        for block in self.blocks:
            assert block.ref_count >= 0, f"block {block.block_id} has a negative ref count"
            assert block.ref_count == owners[block.block_id], (
                f"block {block.block_id}: ref count {block.ref_count}, "
                f"held by {owners[block.block_id]} tables")
            in_use = block.ref_count > 0
            assert in_use != (block.block_id in free_set), (
                f"block {block.block_id} is {'both' if in_use else 'neither'} free and in use")
