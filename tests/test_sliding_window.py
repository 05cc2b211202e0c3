"""Sliding windows in the engine: a Mistral whose every layer is windowed runs requests far
longer than its KV cache could hold whole (blocks behind the window go back), matches
transformers there, and prefix caching stays exact across requests sharing a prefix
longer than the window."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stallfree import LLM, SamplingParams
from tiny_models import build_tiny_model, save_tiny_model

WINDOW, BLOCK = 16, 16
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * BLOCK  # layers x K,V x kv heads x head_dim x fp32 bytes
LONG = [(13 * j + 5) % 4000 + 10 for j in range(150)]
STEPS = 12


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    extra = dict(sliding_window=WINDOW, attn_implementation="eager")
    path = save_tiny_model(tmp_path_factory.mktemp("window"), "mistral", **extra)
    return path, build_tiny_model("mistral", **extra)


def _greedy(ref, prompt: list[int], steps: int = STEPS) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_a_request_longer_than_the_cache_runs_within_its_window(mistral):
    """8 blocks (128 tokens) for a 150-token prompt plus 12: only the window's blocks and
    the chunk's are ever held."""
    path, ref = mistral
    llm = LLM(path, dtype="float32", block_size=BLOCK, kv_cache_memory=8 * BLOCK_BYTES,
              max_num_batched_tokens=16, enable_prefix_caching=False)
    bm = llm.engine.block_manager
    assert bm.num_total_blocks == 8 and bm.sliding_window == WINDOW
    engine, held = llm.engine, []
    engine.add_request("long", LONG, SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                    ignore_eos=True))
    tokens = []
    while engine.has_unfinished_requests():
        for out in engine.step().finished:
            tokens = out.token_ids
        table = bm.block_table("long")
        held.append(sum(1 for b in table if b != bm.null_block))
        bm.check_invariants()
    assert tokens == _greedy(ref, LONG)
    assert max(held) <= bm.most_blocks_held(len(LONG) + STEPS, 16) <= 4
    assert bm.num_free_blocks == 8


def test_prefix_caching_is_exact_past_the_window(mistral):
    """Requests sharing a 96-token prefix, one after another: the later ones hit the cache
    (blocks released behind the first one's window stay cached) and give the tokens they
    give without it."""
    path, ref = mistral
    prompts = [LONG[:96] + [100 + i, 200 + i, 300 + i] for i in range(3)]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(path, dtype="float32", block_size=BLOCK, kv_cache_memory=64 * BLOCK_BYTES,
                  enable_prefix_caching=caching)
        outs = [llm.generate([p], params)[0] for p in prompts]
        results[caching] = [o.token_ids for o in outs]
        if caching:
            assert all(o.num_cached_tokens == 96 for o in outs[1:])
    assert results[True] == results[False] == [_greedy(ref, p, 6) for p in prompts]
