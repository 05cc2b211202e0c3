"""One dense and one mixture-of-experts family served over HTTP: the official client's
greedy completions (several at once, so they share batches) equal transformers'."""
from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import openai
import pytest
import torch

from server_utils import ServerProcess
from tiny_models import build_tiny_model, default_tokenizer, save_tiny_model

PROMPTS = [[(7 * j + 3 * i) % 5000 + 10 for j in range(20 + 9 * i)] for i in range(4)]
STEPS = 8


@pytest.fixture(scope="module", params=["gemma2", "mixtral"])
def served(request, tmp_path_factory):
    kind = request.param
    path = save_tiny_model(tmp_path_factory.mktemp(kind), kind)
    proc = ServerProcess(path, "--served-model-name", kind, "--dtype", "float32",
                         "--max-num-batched-tokens", "24", "--kv-cache-memory", str(8 << 20))
    yield kind, proc
    proc.stop()


def _greedy(ref, prompt: list[int]) -> list[int]:
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


def test_served_family_matches_transformers(served):
    kind, proc = served
    client = openai.OpenAI(base_url=proc.url + "/v1", api_key="unused", max_retries=0)

    def complete(prompt: list[int]) -> tuple[str, int]:
        out = client.completions.create(model=kind, prompt=prompt, max_tokens=STEPS,
                                        temperature=0.0, extra_body={"ignore_eos": True})
        return out.choices[0].text, out.usage.completion_tokens

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        got = list(pool.map(complete, PROMPTS))
    ref = build_tiny_model(kind, attn_implementation="eager")
    tokenizer = default_tokenizer()
    assert got == [(tokenizer.decode(_greedy(ref, p)), STEPS) for p in PROMPTS]
