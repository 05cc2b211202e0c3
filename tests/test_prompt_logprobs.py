"""Prompt logprobs in the engine: transformers' values for every prompt token, whatever the
chunking, the prefix cache or n; scoring without generating (max_tokens 0); and a scoring
request's chunks charged to the token budget so that other requests' batches are unchanged."""
from __future__ import annotations

import pytest
import torch

from scheduler_helpers import make_request, new_scheduler, shape, step
from stallfree import LLM, SamplingParams
from stallfree.outputs import PromptLogprobs, TokenLogprobs
from stallfree.request_group import RequestGroup

PROMPT = [100 + (i * 37) % 900 for i in range(70)]


@pytest.fixture(scope="module")
def reference(tiny_model) -> torch.Tensor:
    """transformers' log-softmax over the prompt's positions: [len(PROMPT), vocab]."""
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)
    with torch.no_grad():
        return model.eval()(torch.tensor([PROMPT])).logits[0].log_softmax(-1)


@pytest.fixture(scope="module")
def tiny_llm(tiny_model):
    llm = LLM(tiny_model, dtype="float32", max_model_len=256)
    yield llm
    llm.shutdown()


def _check_against(reference: torch.Tensor, table: list, top: int) -> None:
    assert len(table) == len(PROMPT) and table[0] is None
    for position, entry in enumerate(table[1:], 1):
        row = reference[position - 1]
        assert entry.token_id == PROMPT[position]
        assert entry.logprob == pytest.approx(row[PROMPT[position]].item(), abs=1e-3)
        # Its place among the vocabulary where it is among the top (up to rounding).
        chosen = row[PROMPT[position]]
        if entry.rank is None:
            assert int((row > chosen - 1e-3).sum()) >= top
        else:
            assert entry.token_id == entry.top[entry.rank - 1][0]
            assert int((row > chosen + 1e-3).sum()) < entry.rank
        assert len(entry.top) == top
        if top:
            values, ids = row.topk(top)
            assert [v for _, v in entry.top] == pytest.approx(values.tolist(), abs=1e-3)
            assert entry.top[0][0] == ids[0].item()


@pytest.mark.parametrize("budget", [16, 61, 512])
def test_prompt_logprobs_equal_transformers_whatever_the_chunking(tiny_llm, reference, budget):
    tiny_llm.reconfigure(max_num_batched_tokens=budget)
    out = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=3,
                                                     prompt_logprobs=2))[0]
    _check_against(reference, out.prompt_logprobs, 2)
    assert len(out.token_ids) == 3 and out.outputs[0].logprobs is None


def test_a_cached_prefix_is_recomputed_for_its_logprobs(tiny_llm, reference):
    tiny_llm.reconfigure(max_num_batched_tokens=512)
    warm = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0]
    scored = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1,
                                                        prompt_logprobs=0))[0]
    again = tiny_llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=1))[0]
    # The prompt's blocks were cached by the first request, yet the scoring one computed
    # every position; the next plain request hits the cache again.
    assert again.num_cached_tokens > 0 and scored.num_cached_tokens == 0
    _check_against(reference, scored.prompt_logprobs, 0)
    assert scored.token_ids == warm.token_ids


def test_max_tokens_zero_scores_without_generating(tiny_llm, reference):
    tiny_llm.reconfigure(max_num_batched_tokens=512)
    outs = tiny_llm.generate([PROMPT, PROMPT[:5]],
                             SamplingParams(max_tokens=0, prompt_logprobs=1, n=2))
    for out, length in zip(outs, (len(PROMPT), 5)):
        assert [o.token_ids for o in out.outputs] == [[], []]
        assert [o.finish_reason for o in out.outputs] == ["length", "length"]
        assert len(out.prompt_logprobs) == length
    _check_against(reference, outs[0].prompt_logprobs, 1)
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=21)


def test_a_recompute_keeps_the_first_values():
    group = RequestGroup("r", None, [5, 6, 7], SamplingParams(prompt_logprobs=0, n=2), 0.0,
                         None, frozenset())
    # Only the first sequence scores the prompt: the others may share its cached KV.
    assert [c.sampling_params.prompt_logprobs for c in group.children] == [0, None]
    group.add_prompt_logprobs(PromptLogprobs(1, [TokenLogprobs(6, -1.0, [])]))
    group.add_prompt_logprobs(PromptLogprobs(1, [TokenLogprobs(6, -9.0, []),
                                                 TokenLogprobs(7, -2.0, [])]))
    assert [None if e is None else e.logprob for e in group.prompt_logprobs] == [None, -1.0, -2.0]


def _iterations(scoring: bool, cost: float) -> list[list[tuple[str, int, int]]]:
    sched = new_scheduler("sarathi", budget=16, max_model_len=256, num_blocks=128)
    sched.prompt_logprob_cost = cost
    for rid in ("a", "b"):
        sched.add_request(make_request(rid, 6, max_tokens=40))
    step(sched)
    sched.add_request(make_request("s", 60, max_tokens=1,
                                   prompt_logprobs=0 if scoring else None))
    shapes = []
    while sched.has_unfinished_requests():
        out, _ = step(sched)
        assert out.num_batched_tokens <= 16
        shapes.append(shape(out))
    return shapes


def test_scoring_changes_no_other_requests_batch_and_pays_for_its_logits():
    plain, scored = _iterations(False, 2.0), _iterations(True, 2.0)
    others = [[c for c in it if c[0] != "s"] for it in plain]
    # Every other request's chunks come iteration by iteration as without scoring.
    assert [[c for c in it if c[0] != "s"] for it in scored][:len(others)] == others
    # Two decodes leave 14 tokens: 14 plain prompt tokens, or 7 at twice the cost.
    assert [c[2] for it in plain for c in it if c[0] == "s"][:2] == [14, 14]
    assert [c[2] for it in scored for c in it if c[0] == "s"][:2] == [7, 7]
    assert sum(c[2] for it in scored for c in it if c[0] == "s") == 60


def test_a_logits_row_dearer_than_the_budget_still_progresses():
    # A tiny model's LM head can cost more than a whole budget of layers: one token a turn.
    shapes = _iterations(True, 40.0)
    assert sum(c[2] for it in shapes for c in it if c[0] == "s") == 60
    assert all(c[2] == 1 for it in shapes for c in it if c[0] == "s")
