"""Sampling parameters, the sampler on synthetic logits, and seeded/stop behaviour end to end."""
from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree import SamplingParams
from stallfree.executor.sampler import Sampler, argmax_rows, sample_inverse_cdf
from stallfree.model.kernels import unavailable_reason
from stallfree.request import Request


def _req(params: SamplingParams, outputs: list[int] | None = None, prompt=(1, 2, 3)) -> Request:
    r = Request("r", list(prompt), params, 0.0, eos_token_ids=frozenset({0}))
    r.output_token_ids = list(outputs or [])
    return r


@pytest.mark.parametrize("field,value", [
    ("temperature", -1), ("top_p", 0.0), ("top_p", 2), ("top_k", -5), ("min_p", 1.5),
    ("max_tokens", 1.5), ("max_tokens", -3), ("n", 0), ("seed", "x"), ("stop", [""]),
    ("repetition_penalty", 0), ("presence_penalty", 3), ("frequency_penalty", -2.5),
    ("stop_token_ids", [-1]), ("min_tokens", -1), ("temperature", float("nan")),
    ("prompt_logprobs", -1), ("prompt_logprobs", 21),
])
def test_bad_parameters_name_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_greedy_and_degenerate_filters_pick_the_argmax():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    best = logits.argmax(dim=-1).tolist()
    reqs = [_req(SamplingParams(temperature=0)), _req(SamplingParams(temperature=1, top_k=1)),
            _req(SamplingParams(temperature=1, top_p=1e-6)),
            _req(SamplingParams(temperature=1, min_p=1.0))]
    assert Sampler()(logits, reqs) == best


def test_top_k_only_draws_from_the_top_k():
    logits = torch.arange(20, dtype=torch.float32).repeat(200, 1)
    reqs = [_req(SamplingParams(temperature=5.0, top_k=3)) for _ in range(200)]
    drawn = set(Sampler(seed=1)(logits, reqs))
    assert drawn <= {17, 18, 19} and len(drawn) > 1


def test_top_p_keeps_the_smallest_set_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(300, 1)
    drawn = set(Sampler(seed=2)(logits, [_req(SamplingParams(top_p=0.7)) for _ in range(300)]))
    assert drawn == {0, 1}


def test_sampling_follows_the_distribution_and_never_draws_a_zero():
    probs = torch.tensor([0.0, 0.5, 0.0, 0.3, 0.2, 0.0])
    draws = 20000
    uniform = torch.rand(draws, 1, dtype=torch.float64, generator=torch.Generator().manual_seed(4))
    picked = sample_inverse_cdf(probs.repeat(draws, 1), uniform)
    counts = torch.bincount(picked, minlength=6).double() / draws
    assert counts[[0, 2, 5]].sum() == 0
    # 20,000 draws: a frequency's standard error is at most 0.0036; 5 of them is a bound
    # a fixed seed either meets or not (no flakiness: the draws are fixed).
    assert (counts - probs.double()).abs().max() < 0.018
    edges = torch.tensor([[0.0], [1.0 - 1e-16]], dtype=torch.float64)
    assert sample_inverse_cdf(probs.repeat(2, 1), edges).tolist() == [1, 4]


def test_seeded_rows_do_not_depend_on_their_batch():
    logits = torch.randn(3, 1000, generator=torch.Generator().manual_seed(3))
    seeded = SamplingParams(temperature=1.0, seed=42)
    alone = Sampler(seed=7)(logits[1:2], [_req(seeded)])
    batched = Sampler(seed=9)(logits,
                              [_req(SamplingParams()), _req(seeded), _req(SamplingParams())])
    assert alone[0] == batched[1]


KERNELS_MISSING = unavailable_reason()


@pytest.mark.skipif(KERNELS_MISSING is not None, reason=f"kernels not built: {KERNELS_MISSING}")
@settings(max_examples=60, deadline=None)
@given(rows=st.integers(0, 5), width=st.integers(1, 200), seed=st.integers(0, 2**16),
       levels=st.integers(1, 4), specials=st.lists(
           st.tuples(st.integers(0, 999), st.sampled_from([float("nan"), float("inf"),
                                                           float("-inf")])), max_size=3),
       all_minus_inf=st.booleans())
def test_property_the_argmax_kernel_equals_torch(rows, width, seed, levels, specials,
                                                 all_minus_inf):
    """Widths off and on whole vectors, ties (few distinct values: the first index wins),
    NaN (largest of all, as torch has it), infinities, rows of -inf only."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, width), generator=gen).float()
    for index, value in specials:
        if rows:
            x.view(-1)[index % x.numel()] = value
    if all_minus_inf and rows:
        x[0] = float("-inf")
    assert torch.equal(argmax_rows(x, kernel=True), x.argmax(dim=-1))


@pytest.mark.parametrize("params,outputs", [
    (SamplingParams(temperature=0), []),                          # nothing edits: no copy
    (SamplingParams(temperature=0, min_tokens=5), []),            # eos held off
    (SamplingParams(temperature=0, repetition_penalty=1.5), []),  # the prompt's tokens
    (SamplingParams(temperature=0.7, seed=1, frequency_penalty=1.0), [4]),
])
def test_the_sampler_leaves_the_callers_logits_raw(params, outputs):
    """Each reason to edit a row alone: the rows are edited in a copy, never in the logits
    the caller keeps for log-probabilities."""
    logits = torch.randn(2, 40, generator=torch.Generator().manual_seed(3))
    logits[:, 0] = 9.0  # eos (token 0) the best, so min_tokens has something to hold off
    raw = logits.clone()
    Sampler()(logits, [_req(params, outputs=outputs), _req(SamplingParams(temperature=0))])
    assert torch.equal(logits, raw)


def test_penalties_and_min_tokens():
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    # Token 1 was already generated, so a frequency penalty hands the win to token 2.
    assert Sampler()(logits, [_req(SamplingParams(temperature=0, frequency_penalty=1.0),
                                   outputs=[1])]) == [2]
    assert Sampler()(logits, [_req(SamplingParams(temperature=0, repetition_penalty=2.0),
                                   prompt=[1])]) == [2]
    eos_best = torch.tensor([[9.0, 1.0, 0.5, 0.1]])  # token 0 is eos here
    assert Sampler()(eos_best, [_req(SamplingParams(temperature=0, min_tokens=2))]) == [1]
    assert Sampler()(eos_best, [_req(SamplingParams(temperature=0))]) == [0]


def test_seeded_generation_is_reproducible(default_llm):
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    params = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=16)
    first = default_llm.generate(["Tell me a story about a cat."], params)[0].token_ids
    crowd = ["Hello there", "List three fruits:", "Tell me a story about a cat."]
    again = default_llm.generate(crowd, params)[2].token_ids
    other = default_llm.generate(["Tell me a story about a cat."],
                                 SamplingParams(temperature=0.9, top_p=0.95, seed=99,
                                                max_tokens=16))[0].token_ids
    assert first == again
    assert first != other


def test_n_sequences_and_stop_strings(default_llm):
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    out = default_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=1.0, n=3, seed=5,
                                                               max_tokens=8))[0]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(len(o.token_ids) > 0 for o in out.outputs)
    full = default_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20))[0]
    assert " 7" in full.text
    stopped = default_llm.generate("1, 2, 3, 4,", SamplingParams(temperature=0, max_tokens=20,
                                                                  stop=[" 7"]))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == full.text[:full.text.index(" 7")]


def test_bad_prompts_raise_clear_errors(default_llm):
    with pytest.raises(ValueError, match="max_model_len"):
        default_llm.generate([[5] * 5000], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="empty"):
        default_llm.generate([[]], SamplingParams(max_tokens=4))
    with pytest.raises(ValueError, match="token ids"):
        default_llm.generate([[10**9]], SamplingParams(max_tokens=4))
    assert not default_llm.engine.has_unfinished_requests()


def test_logprobs_match_the_reference_distribution(default_llm, hf_reference):
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    ids = default_llm.engine.tokenize("The capital of France is")
    out = default_llm.generate([ids], SamplingParams(temperature=0, max_tokens=3, logprobs=4))[0]
    steps = out.outputs[0].logprobs
    assert [s.token_id for s in steps] == out.token_ids
    with torch.inference_mode():
        ref = hf_reference(torch.tensor([ids])).logits[0, -1].float().log_softmax(-1)
    first = steps[0]
    assert first.logprob == pytest.approx(float(ref[first.token_id]), abs=1e-4)
    assert [t for t, _ in first.top] == ref.topk(4).indices.tolist()
    assert default_llm.generate([ids], SamplingParams(max_tokens=2))[0].outputs[0].logprobs is None


def test_tiny_temperatures_sample_greedily():
    # 1e-40 is a float32 denormal: logits / 1e-40 would be inf/NaN and sample garbage.
    logits = torch.randn(3, 500, generator=torch.Generator().manual_seed(4)) * 10
    best = logits.argmax(dim=-1).tolist()
    for temperature in (1e-40, 1e-20, 9.9e-6):
        params = SamplingParams(temperature=temperature, seed=3)
        assert params.greedy
        assert Sampler(seed=5)(logits, [_req(params) for _ in range(3)]) == best
    assert not SamplingParams(temperature=1e-5).greedy


def test_presence_penalty_counts_a_token_once():
    logits = torch.tensor([[0.0, 5.0, 4.5, 1.0]])
    once, thrice = [1], [1, 1, 1]
    presence = SamplingParams(temperature=0, presence_penalty=0.6)
    # 5.0 - 0.6 = 4.4 < 4.5 whether token 1 came once or three times.
    assert Sampler()(logits, [_req(presence, outputs=once)]) == [2]
    assert Sampler()(logits, [_req(presence, outputs=thrice)]) == [2]
    frequency = SamplingParams(temperature=0, frequency_penalty=0.3)
    assert Sampler()(logits, [_req(frequency, outputs=once)]) == [1]  # 4.7 still wins
    assert Sampler()(logits, [_req(frequency, outputs=thrice)]) == [2]  # 4.1 loses
    assert Sampler()(logits, [_req(presence)]) == [1]  # nothing generated yet: no penalty


def test_min_p_keeps_tokens_at_least_p_times_the_best():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().repeat(300, 1)
    # min_p 0.5 keeps p >= 0.25: tokens 0 and 1; 0.2 keeps p >= 0.1: tokens 0, 1 and 2.
    for min_p, kept in ((0.5, {0, 1}), (0.2, {0, 1, 2})):
        reqs = [_req(SamplingParams(min_p=min_p)) for _ in range(300)]
        assert set(Sampler(seed=6)(logits, reqs)) == kept


def test_min_tokens_holds_off_stop_strings_end_to_end(default_llm):
    default_llm.reconfigure(token_budget=512, kv_cache_memory=None)
    prompt = "1, 2, 3, 4,"
    full = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16))[0]
    first = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                        stop=[","]))[0]
    held = default_llm.generate(prompt, SamplingParams(temperature=0, max_tokens=16,
                                                       stop=[","], min_tokens=4))[0]
    assert first.text == full.text[:full.text.index(",")]
    # The commas among the first 4 tokens pass; the text stops at the next one.
    assert held.finish_reason == "stop" and "," in held.text and len(held.token_ids) >= 4
    assert full.text.startswith(held.text) and len(held.text) > len(first.text)
    assert full.text[len(held.text)] == ","
