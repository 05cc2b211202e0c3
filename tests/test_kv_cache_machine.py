"""The block manager with prefix caching as a hypothesis state machine.

Requests with overlapping prompts are admitted after their cached prefix, computed in
chunks (the fake executor writes their KV into an oracle), decoded, freed (finished,
preempted or aborted, mid-chunk too) and the cache reset, in any order. After every
step: reference counts are never negative, no block is both free and referenced, every
cached key names exactly the tokens (and everything before them) written into its block,
no two blocks share a key, and a hit only ever shares blocks holding the right KV.
"""
from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule

from stallfree.request import Request
from stallfree.sampling_params import SamplingParams
from stallfree.scheduler.kv_cache import BlockManager
from stallfree.scheduler.prefix_cache import chain_keys

# Prompts start with one of a few stems, so that prefixes overlap often.
STEMS = [[1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12], [1, 2, 3, 4, 9, 9, 9, 9, 5, 5, 5, 5],
         [7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7]]


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(4, 16), block_size=st.integers(1, 4))
    def setup(self, num_blocks: int, block_size: int) -> None:
        self.bm = BlockManager(num_blocks, block_size, watermark=0.0, namespace=b"test")
        self.requests: dict[str, Request] = {}
        self.pending: dict[str, tuple[int, int]] = {}  # id -> (start, tokens) being computed
        self.written: dict[int, tuple[int, ...]] = {}  # block -> token ids from position 0
        self.next_id = 0

    # ---- helpers ------------------------------------------------------------------
    def _pick(self, data: st.DataObject, holding: bool | None) -> Request | None:
        ids = sorted(rid for rid in self.requests
                     if holding is None or bool(self.bm.block_table(rid)) == holding)
        return self.requests[data.draw(st.sampled_from(ids))] if ids else None

    def _start_chunk(self, r: Request, start: int, n: int) -> None:
        table = self.bm.block_table(r.request_id)
        bs = self.bm.block_size
        for i in range(start // bs, self.bm.num_blocks_for(start + n)):
            assert self.bm.blocks[table[i]].ref_count == 1, "a chunk would write a shared block"
        self.pending[r.request_id] = (start, n)

    def _write(self, r: Request) -> None:
        start, n = self.pending.pop(r.request_id)
        table, bs, tokens = self.bm.block_table(r.request_id), self.bm.block_size, r.all_token_ids
        for i in range(start // bs, self.bm.num_blocks_for(start + n)):
            self.written[table[i]] = tuple(tokens[:min((i + 1) * bs, start + n)])

    # ---- rules ------------------------------------------------------------------------
    @rule(stem=st.integers(0, len(STEMS) - 1), keep=st.integers(0, 12),
          tail=st.lists(st.integers(20, 22), max_size=6))
    def new_request(self, stem: int, keep: int, tail: list[int]) -> None:
        tokens = STEMS[stem][:keep] + tail or [30]
        rid = f"r{self.next_id}"
        self.next_id += 1
        self.requests[rid] = Request(rid, tokens, SamplingParams(), 0.0)

    @rule(data=st.data(), chunk=st.integers(1, 12))
    def admit(self, data: st.DataObject, chunk: int) -> None:
        r = self._pick(data, holding=False)
        if r is None:
            return
        hit = self.bm.find_cached_prefix(r)
        assert hit.num_tokens <= r.num_tokens - 1 and hit.num_tokens % self.bm.block_size == 0
        tokens, bs = r.all_token_ids, self.bm.block_size
        for i, block_id in enumerate(hit.block_ids):  # a hit shares only the right KV
            assert self.written[block_id] == tuple(tokens[:(i + 1) * bs])
        n = min(chunk, r.num_tokens - hit.num_tokens)
        free_before = self.bm.num_free_blocks
        if not self.bm.can_allocate(r, n, use_watermark=False, hit=hit):
            try:
                self.bm.allocate(r, n, hit)
            except RuntimeError:
                assert self.bm.num_free_blocks == free_before
                assert self.bm.block_table(r.request_id) == []
                return
            raise AssertionError("allocate succeeded where can_allocate said no")
        self.bm.allocate(r, n, hit)
        r.num_computed_tokens = hit.num_tokens
        self._start_chunk(r, hit.num_tokens, n)

    @rule(data=st.data(), sample=st.integers(20, 22))
    def complete(self, data: st.DataObject, sample: int) -> None:
        """The iteration of a pending chunk completed: its KV is written."""
        ids = sorted(self.pending)
        if not ids:
            return
        r = self.requests[data.draw(st.sampled_from(ids))]
        n = self.pending[r.request_id][1]
        self._write(r)
        r.num_computed_tokens += n
        if r.num_computed_tokens == r.num_tokens:
            r.output_token_ids.append(sample)
        self.bm.cache_computed_blocks(r)

    @rule(data=st.data(), chunk=st.integers(1, 8))
    def grow(self, data: st.DataObject, chunk: int) -> None:
        r = self._pick(data, holding=True)
        if r is None or r.request_id in self.pending:
            return
        n = min(chunk, r.num_tokens - r.num_computed_tokens)
        if n == 0 or not self.bm.can_allocate(r, n, use_watermark=False):
            return
        self.bm.allocate(r, n)
        self._start_chunk(r, r.num_computed_tokens, n)

    @rule(data=st.data(), ran=st.booleans(), forget=st.booleans())
    def free(self, data: st.DataObject, ran: bool, forget: bool) -> None:
        """Finished, preempted or aborted; a pending chunk may have run (its KV written,
        never cached) or not."""
        r = self._pick(data, holding=True)
        if r is None:
            return
        if r.request_id in self.pending:
            if ran:
                self._write(r)
            else:
                del self.pending[r.request_id]
        self.bm.free(r)
        r.num_computed_tokens = 0
        if forget:
            del self.requests[r.request_id]

    @rule()
    def reset(self) -> None:
        before = self.bm.num_cached_blocks
        assert self.bm.reset_prefix_cache() == before
        assert self.bm.num_cached_blocks == self.bm.num_evictable_blocks == 0

    # ---- invariants --------------------------------------------------------------------
    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        bm.check_invariants()
        refs = [0] * bm.num_total_blocks
        for rid in self.requests:
            for block_id in bm.block_table(rid):
                refs[block_id] += 1
        for block in bm.blocks:
            assert block.ref_count == refs[block.block_id] >= 0
            lists = bm.lists_holding(block.block_id)
            # Referenced blocks are on no list; the others on exactly one, by their key.
            assert lists == ([] if refs[block.block_id] else
                             ["evictable"] if block.key is not None else ["free"])
        held = sum(1 for n in refs if n)
        assert bm.num_free_blocks + held == bm.num_total_blocks

    @invariant()
    def keys_match_tokens(self) -> None:
        bm = self.bm
        keyed = [b for b in bm.blocks if b.key is not None]
        assert len({b.key for b in keyed}) == len(keyed), "two blocks share a key"
        assert len(keyed) == bm.num_cached_blocks
        for block in keyed:
            tokens = self.written[block.block_id]
            assert len(tokens) % bm.block_size == 0 and tokens, "a partial block is cached"
            assert chain_keys(tokens, bm.block_size, bm.root_key)[-1] == block.key


BlockManagerMachine.TestCase.settings = settings(max_examples=60, stateful_step_count=40,
                                                 deadline=None)
test_block_manager_state_machine = BlockManagerMachine.TestCase
