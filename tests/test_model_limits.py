"""Edges of the model's numerics: sliding windows do not limit the context, and NaN left in KV
blocks (by a request that overflowed, or a block's previous owner) reaches nobody else."""
from __future__ import annotations

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.model.config import ModelConfig

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_a_sliding_window_does_not_cap_max_model_len(tmp_path):
    from tiny_models import save_tiny_model

    path = save_tiny_model(tmp_path, "mistral", sliding_window=48, max_position_embeddings=256)
    llm = LLM(path, max_model_len=200, kv_cache_memory=1 << 20)
    assert llm.engine.max_model_len == 200
    out = llm.generate([[5] * 100], SamplingParams(max_tokens=20, ignore_eos=True))[0]
    assert len(out.token_ids) == 20 and out.finish_reason == "length"
    # Windows as long as the positions (or none) are full attention.
    base = dict(architecture="llama", vocab_size=10, hidden_size=8, intermediate_size=8,
                num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=4,
                max_position_embeddings=256)
    assert ModelConfig(**base, sliding_window=4096).layer_window(0) is None
    assert ModelConfig(**base).layer_window(1) is None
    flags = ModelConfig(**base, sliding_window=16, window_layers=[True, False])
    assert (flags.layer_window(0), flags.layer_window(1)) == (16, None)
    with pytest.raises(ValueError, match="window_layers"):
        ModelConfig(**base, sliding_window=16, window_layers=[True])


def _free_blocks(llm: LLM, live: list[str]) -> list[int]:
    bm = llm.engine.block_manager
    held = {b for rid in live for b in bm.block_table(rid)}
    return [b for b in range(bm.num_total_blocks) if b not in held]


def _run(llm: LLM, prompts: dict[str, list[int]], poison=None) -> dict[str, list[int]]:
    """Steps the engine over `prompts` (added in order); `poison(live ids)` after each step."""
    engine = llm.engine
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, GREEDY)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step().finished:
            done[out.request_id] = out.token_ids
        if poison is not None:
            poison([rid for rid in prompts if rid not in done])
    return done


PROMPTS = {"long": [(3 * j) % 4000 + 10 for j in range(37)],
           "short": [(5 * j) % 4000 + 10 for j in range(9)],
           "mid": [(7 * j) % 4000 + 10 for j in range(21)]}


def _fresh_cache(llm: LLM) -> torch.Tensor:
    """A new zeroed KV cache and block manager (blocks are handed out from 0 again)."""
    llm.reconfigure(token_budget=64)
    return llm.engine.executor.runner.kv_cache  # [layers, 2, blocks, block_size, heads, dim]


def test_nan_in_freed_and_foreign_kv_blocks_reaches_no_request(tiny_model):
    llm = LLM(tiny_model, token_budget=64, block_size=8, max_model_len=128,
              kv_cache_memory=1 << 20)
    clean = _run(llm, PROMPTS)

    # Every block nobody holds is NaN at every step: a block a request is handed next
    # (its unwritten tail included) must not leak it into attention.
    kv = _fresh_cache(llm)

    def poison_free(live: list[str]) -> None:
        kv[:, :, _free_blocks(llm, live)] = float("nan")

    assert _run(llm, PROMPTS, poison_free) == clean

    # A request whose own cache is NaN (say its activations overflowed) gets garbage,
    # but the requests decoding beside it, padded to its length, must not. It is added
    # first, so it holds block 0 (a natural padding choice).
    kv = _fresh_cache(llm)

    def poison_long(live: list[str]) -> None:
        if "long" in live:
            table = llm.engine.block_manager.block_table("long")
            assert table[0] == 0
            kv[:, :, table] = float("nan")

    poisoned = _run(llm, PROMPTS, poison_long)
    assert poisoned["short"] == clean["short"] and poisoned["mid"] == clean["mid"]
    assert poisoned["long"] != clean["long"]  # the poison was real
