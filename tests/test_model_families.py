"""Every registered family against transformers: a tiny random model of each, built from
transformers' own config class and saved as a Hugging Face directory, gives the same greedy
tokens through our engine in float32, with prompts longer than its sliding window and
prefills cut into chunks that cross it."""
from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.model import load_model
from stallfree.model.families import FAMILIES, config_from_hf
from tiny_models import FAMILIES as TINY
from tiny_models import build_tiny_model, save_tiny_model

WINDOW = 16
# Per family: what the tiny model sets beyond tiny_models' defaults for this test.
CASES = {kind: {} for kind in TINY} | {"mistral": dict(sliding_window=WINDOW)}
PROMPTS = [[(7 * j + 3) % 5000 + 10 for j in range(41)], [(11 * j) % 3000 + 20 for j in range(9)]]
STEPS = 10


def _hf_greedy(ref, prompt: list[int], steps: int) -> list[int]:
    """Greedy continuation by full forwards (no cache: the reference at its plainest)."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(steps):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module", params=sorted(CASES))
def family_model(request, tmp_path_factory):
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    path = save_tiny_model(folder, kind, attn_implementation="eager", **CASES[kind])
    ref = build_tiny_model(kind, attn_implementation="eager", **CASES[kind])
    return kind, path, ref


def test_every_registered_family_is_tested():
    covered = {config_from_hf(_config_dict(kind)).architecture for kind in TINY}
    assert covered == set(FAMILIES)


def _config_dict(kind: str) -> dict:
    return build_tiny_model(kind).config.to_dict() | {
        "architectures": [TINY[kind][1]]}


def test_greedy_tokens_match_transformers(family_model):
    kind, path, ref = family_model
    expected = [_hf_greedy(ref, p, STEPS) for p in PROMPTS]
    # A budget under the window: the long prompt's chunks cross the window's edge.
    llm = LLM(path, dtype="float32", max_num_batched_tokens=12, kv_cache_memory=8 << 20,
              block_size=16)
    outs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                ignore_eos=True))
    assert [o.token_ids for o in outs] == expected, kind


def test_logits_match_transformers(family_model):
    """The last position's logits in one unchunked forward, within float32 rounding: a
    check that is finer than the greedy tokens."""
    kind, path, ref = family_model
    model, config = load_model(path, torch.float32, "cpu")
    ids = PROMPTS[0]
    with torch.no_grad():
        want = ref(torch.tensor([ids])).logits[0, -1].float()
    llm = LLM(path, dtype="float32", kv_cache_memory=8 << 20, block_size=16)
    got = llm.generate([ids], SamplingParams(temperature=0.0, max_tokens=1, logprobs=5))[0]
    top = torch.topk(torch.log_softmax(want, -1), 5)
    assert got.token_ids[0] == int(top.indices[0])
    ours = dict(got.outputs[0].logprobs[0].top)
    for token, value in zip(top.indices.tolist(), top.values.tolist()):
        assert abs(ours[token] - value) < 1e-3, (kind, token)
    assert config.architecture in FAMILIES and model.config is config
