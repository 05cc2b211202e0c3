"""Prefix caching on the default model: greedy tokens identical with and without it.

Alone, for questions after a cached system prompt among 20 other requests, and for
n > 1, plus exact counts of the tokens computed. (test_engine.py compares every token
budget of the chunking tests and forced preemption with references run without it.)
"""
from __future__ import annotations

import os

import pytest

from stallfree import SamplingParams

MAX_TOKENS = 8
BLOCK = 16
SYSTEM = ("You are the librarian of a small town. You answer questions about the library's "
          "opening hours, its catalogue, the rules for borrowing books and the events it "
          "hosts. Be brief, polite and precise; when you do not know, say so. The library "
          "opens at nine and closes at six, except on Sundays, when it is closed. Members may "
          "borrow five books for three weeks; overdue books cost ten cents a day. ")
QUESTIONS = ["When does the library open?", "How many books can I borrow?",
             "Is the library open on Sunday?", "What do overdue books cost?",
             "Can I borrow a book for a month?", "Who are you?"]


def _greedy(n: int = 1) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, n=n)


def _cached_len(num_tokens: int) -> int:
    """What a full hit shares: whole blocks, leaving at least one token to compute."""
    return (num_tokens - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def prompts(default_llm) -> list[list[int]]:
    tokenize = default_llm.engine.tokenize
    return [tokenize(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\n{q}<|im_end|>\n"
                     f"<|im_start|>assistant\n") for q in QUESTIONS]


@pytest.fixture(scope="module")
def reference(default_llm, prompts) -> list[list[int]]:
    """Each prompt alone, whole, without prefix caching."""
    default_llm.reconfigure(token_budget=4096, kv_cache_memory=None, enable_prefix_caching=False)
    out = [default_llm.generate([ids], _greedy())[0].token_ids for ids in prompts]
    default_llm.reconfigure(enable_prefix_caching=True)
    return out


def _computed_tokens(engine, since: int) -> int:
    return sum(r.num_prefill_tokens + r.num_decode_tokens for r in list(engine.iterations)[since:])


def test_a_repeated_prompt_alone_computes_only_its_tail(default_llm, prompts, reference):
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    engine = default_llm.engine
    ids = prompts[0]
    first = default_llm.generate([ids], _greedy())[0]
    mark = len(engine.iterations)
    second = default_llm.generate([ids], _greedy())[0]
    assert first.token_ids == second.token_ids == reference[0]
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, _cached_len(len(ids)))
    # The uncached prompt tokens, then one token per decode.
    assert _computed_tokens(engine, mark) == len(ids) - _cached_len(len(ids)) + MAX_TOKENS - 1
    stats = engine.stats()
    assert (stats.prefix_cache_queries, stats.prefix_cache_hits) == (2 * len(ids),
                                                                     _cached_len(len(ids)))


def test_questions_after_a_cached_system_prompt_among_20_others(default_llm, prompts,
                                                                reference):
    default_llm.reconfigure(token_budget=64, kv_cache_memory=None)
    engine = default_llm.engine
    engine.reset_prefix_cache()
    # Warm the cache with the system prompt, then run every question among 20 others.
    system = os.path.commonprefix(prompts)  # the system prompt, up to the questions
    default_llm.generate([system], SamplingParams(max_tokens=1))
    others = [[(7 * i + j) % 5000 + 100 for j in range(5 + 2 * i)] for i in range(20)]
    other_params = [SamplingParams(temperature=0.0, max_tokens=3 + i % 4, ignore_eos=True)
                    for i in range(20)]
    batch = others[:10] + prompts + others[10:]
    params = other_params[:10] + [_greedy()] * len(prompts) + other_params[10:]
    outputs = default_llm.generate(batch, params)
    ours = outputs[10:10 + len(prompts)]
    assert [o.token_ids for o in ours] == reference
    # Each question found the system prompt's whole blocks (the first to be admitted may
    # also have cached a block of its own that a later, equal-so-far one shares).
    assert all(o.num_cached_tokens >= len(system) // BLOCK * BLOCK for o in ours)
    assert all(o.num_cached_tokens == 0 for o in outputs[:10] + outputs[10 + len(prompts):])
    bm = engine.block_manager
    assert bm.num_free_blocks == bm.num_total_blocks and bm.num_evictable_blocks > 0
    assert max(r.num_prefill_tokens + r.num_decode_tokens for r in engine.iterations) <= 64


def test_n_sequences_share_one_prefill_of_the_prompt(default_llm, prompts, reference):
    default_llm.reconfigure(token_budget=64, kv_cache_memory=None)
    engine = default_llm.engine
    engine.reset_prefix_cache()
    ids = prompts[1]
    mark = len(engine.iterations)
    out = default_llm.generate([ids], _greedy(n=3))[0]
    assert [o.token_ids for o in out.outputs] == [reference[1]] * 3
    tail = len(ids) - _cached_len(len(ids))
    # The prompt once, each other sequence only its uncached tail, then the decodes.
    assert _computed_tokens(engine, mark) == len(ids) + 2 * tail + 3 * (MAX_TOKENS - 1)
    assert out.num_cached_tokens == 0


def test_reconfigure_and_reset_empty_the_cache(default_llm, prompts):
    one = SamplingParams(max_tokens=1)
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    engine = default_llm.engine
    default_llm.generate([prompts[2]], one)
    assert engine.block_manager.num_cached_blocks > 0
    assert engine.reset_prefix_cache() > 0
    assert default_llm.generate([prompts[2]], one)[0].num_cached_tokens == 0
    default_llm.reconfigure(token_budget=256, enable_prefix_caching=False)
    assert engine.block_manager.num_cached_blocks == 0 and engine.stats().prefix_cache_queries == 0
    default_llm.generate([prompts[2]], one)
    again = default_llm.generate([prompts[2]], one)[0]
    assert again.num_cached_tokens == 0 and engine.block_manager.num_cached_blocks == 0
    default_llm.reconfigure(token_budget=512, enable_prefix_caching=True)
