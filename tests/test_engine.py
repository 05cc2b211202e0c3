"""End-to-end engine checks on the default model against Hugging Face transformers.

The references run without prefix caching, the runs compared with them with it (the
default): the batched prompts find themselves cached, and a preempted request's
recompute finds its own blocks."""
from __future__ import annotations

import pytest
import torch

from stallfree import SamplingParams
from stallfree.model.decoder import kv_cache_bytes_per_token

MAX_TOKENS = 12


def _long_prompt(seed: int, items: int) -> str:
    colors = ["red", "green", "blue", "yellow", "purple", "orange", "white"]
    lines = [f"Item {i}: the {colors[(i * seed) % 7]} box on shelf {(i * 3 + seed) % 11} "
             f"holds {i * 7 + seed} marbles." for i in range(items)]
    return "Inventory list.\n" + "\n".join(lines) + "\nQuestion: which box holds the most marbles?"


PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village by the sea,",
    "1, 2, 3, 4, 5,",
    "Translate to French: I like green apples.",
    "<|im_start|>user\nWhat is the boiling point of water?<|im_end|>\n<|im_start|>assistant\n",
    _long_prompt(3, 52),
    _long_prompt(5, 60),
]


def _greedy_reference(model, prompt_ids: list[int], steps: int):
    """Plain greedy decoding with transformers' own KV cache; returns tokens and logits."""
    tokens, logits = [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt_ids]), use_cache=True)
        for _ in range(steps):
            last = out.logits[0, -1].float()
            token = int(last.argmax())
            tokens.append(token)
            logits.append(last)
            out = model(torch.tensor([[token]]), past_key_values=out.past_key_values,
                        use_cache=True)
    return tokens, logits


def _greedy() -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)


@pytest.fixture(scope="module")
def prompt_ids(default_llm) -> list[list[int]]:
    ids = [default_llm.engine.tokenize(p) for p in PROMPTS]
    assert max(len(i) for i in ids) > 1000, "the long prompts must exceed 1,000 tokens"
    return ids


@pytest.fixture(scope="module")
def unchunked(default_llm, prompt_ids) -> list[list[int]]:
    """Each prompt alone, whole prefill in one iteration, without prefix caching."""
    default_llm.reconfigure(token_budget=4096, kv_cache_memory=None, enable_prefix_caching=False)
    tokens = [default_llm.generate([ids], _greedy())[0].token_ids for ids in prompt_ids]
    default_llm.reconfigure(enable_prefix_caching=True)
    return tokens


def test_greedy_matches_transformers(hf_reference, prompt_ids, unchunked):
    for ids, ours in zip(prompt_ids, unchunked):
        ref_tokens, ref_logits = _greedy_reference(hf_reference, ids, MAX_TOKENS)
        for step, (a, b) in enumerate(zip(ours, ref_tokens)):
            if a != b:
                top2 = ref_logits[step].topk(2).values
                # A near-tie in the reference may flip on float rounding; nothing else may.
                assert float(top2[0] - top2[1]) < 1e-3, (
                    f"diverged at step {step} for a {len(ids)}-token prompt: {a} vs {b}")
                break
        assert len(ours) == MAX_TOKENS


@pytest.mark.parametrize("budget", [16, 64, 512, 4096])
def test_chunked_prefill_gives_unchunked_tokens(default_llm, prompt_ids, unchunked, budget):
    default_llm.reconfigure(token_budget=budget, kv_cache_memory=None)
    if budget < max(len(ids) for ids in prompt_ids):  # else "alone" is the unchunked baseline
        alone = [default_llm.generate([ids], _greedy())[0].token_ids for ids in prompt_ids]
        assert alone == unchunked
    else:  # warm the prefix cache all the same
        default_llm.generate(prompt_ids, SamplingParams(max_tokens=1))
    others = [[(7 * i + j) % 5000 + 100 for j in range(5 + 5 * i)] for i in range(20)]
    other_params = [SamplingParams(temperature=0.0, max_tokens=4 + i % 9, ignore_eos=True)
                    for i in range(20)]
    # Interleave so the prompts under test share iterations with the others.
    batch = others[:10] + prompt_ids + others[10:]
    params = other_params[:10] + [_greedy()] * len(prompt_ids) + other_params[10:]
    outputs = default_llm.generate(batch, params)
    assert [o.token_ids for o in outputs[10:10 + len(prompt_ids)]] == unchunked
    # The prompts ran first: in the batch their whole blocks came from the cache.
    assert [o.num_cached_tokens for o in outputs[10:10 + len(prompt_ids)]] == [
        (len(ids) - 1) // 16 * 16 for ids in prompt_ids]
    engine = default_llm.engine
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks
    if budget < 1000:
        assert max(r.num_prefill_tokens + r.num_decode_tokens for r in engine.iterations) <= budget


def test_preemption_keeps_every_request_and_its_tokens(default_llm):
    prompts = [[(11 * i + j) % 3000 + 200 for j in range(40 + 12 * i)] for i in range(8)]
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    default_llm.reconfigure(token_budget=128, kv_cache_memory=None, enable_prefix_caching=False)
    expected = [o.token_ids for o in default_llm.generate(prompts, params)]
    engine = default_llm.engine
    block_bytes = kv_cache_bytes_per_token(engine.model_config, engine.dtype) * 16
    default_llm.reconfigure(token_budget=128, kv_cache_memory=20 * block_bytes,
                            enable_prefix_caching=True)
    outputs = default_llm.generate(prompts, params)
    assert [o.token_ids for o in outputs] == expected
    assert sum(o.outputs[0].num_preemptions for o in outputs) > 0, "the budget forced no preemption"
    # The prompts share nothing: the hits are recomputes finding their own cached blocks.
    assert all(o.num_cached_tokens == 0 for o in outputs)
    assert engine.stats().prefix_cache_hits > 0
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_total_blocks == 20
    default_llm.reconfigure(kv_cache_memory=None)
