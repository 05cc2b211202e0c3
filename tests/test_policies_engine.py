"""Every policy gives the same greedy tokens on the real default model: scheduling
changes timing, never results."""
from __future__ import annotations

import pytest

from stallfree import SamplingParams
from stallfree.config import POLICIES

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Water boils at",
           "A list of prime numbers: 2, 3, 5,",
           "Report.\n" + " ".join(f"Line {i}: value {i * 13 % 97}." for i in range(40))]


@pytest.fixture(scope="module")
def reference(default_llm) -> list[list[int]]:
    default_llm.reconfigure(policy="sarathi", token_budget=4096, kv_cache_memory=None)
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    return [o.token_ids for o in default_llm.generate(PROMPTS, params)]


@pytest.mark.parametrize("policy", [p for p in POLICIES if p != "sarathi"] + ["sarathi"])
def test_policy_gives_the_reference_tokens(default_llm, reference, policy):
    default_llm.reconfigure(policy=policy, token_budget=32, kv_cache_memory=None)
    params = [SamplingParams(temperature=0.0, max_tokens=10 - i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    outputs = default_llm.generate(PROMPTS, params)
    assert [o.token_ids for o in outputs] == [ref[:10 - i] for i, ref in enumerate(reference)]
    engine = default_llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    default_llm.reconfigure(policy="sarathi", token_budget=512)
