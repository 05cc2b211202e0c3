"""benchmarks/perplexity.py: the perplexity it computes from the engine's prompt logprobs
equals transformers' on the same windows of the shipped essay, and the essay is the one
its README describes (same bytes, at least 4000 tokens)."""
from __future__ import annotations

import hashlib
import importlib.util
import math
import re
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).parent.parent / "benchmarks" / "perplexity.py"
TEXT_DIR = Path(__file__).parent.parent / "stallfree" / "data" / "text"
# The first ~300 tokens in windows of 128: three prompts, the last one short, so that
# both the full windows and the kept tail are checked, in seconds.
PREFIX_TOKENS, WINDOW = 300, 128


@pytest.fixture(scope="module")
def script():
    """The benchmark script as a module (benchmarks/ is not a package)."""
    spec = importlib.util.spec_from_file_location("perplexity_benchmark", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def essay_ids(default_llm) -> list[int]:
    text = (TEXT_DIR / "perplexity_essay.txt").read_text(encoding="utf-8")
    return default_llm.engine.tokenize(text)


def _transformers_perplexity(model, prompts: list[list[int]]) -> tuple[float, int]:
    """exp(-mean logprob) of every token but each window's first, each window run alone
    through transformers (summed in float64 so the sum adds no rounding of its own)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.tensor([prompt])
            logprobs = model(ids).logits[0].float().log_softmax(-1)
            # Row i predicts token i + 1.
            chosen = logprobs[:-1].gather(1, ids[0, 1:, None])
            total += chosen.double().sum().item()
            count += len(prompt) - 1
    return math.exp(-total / count), count


def test_engine_perplexity_equals_transformers(script, default_llm, hf_reference, essay_ids):
    assert default_llm.engine.info.dtype == "float32"
    ids = essay_ids[:PREFIX_TOKENS]
    ppl, scored = script.perplexity(default_llm, ids, WINDOW)
    prompts = script.windows(ids, WINDOW)
    assert [len(p) for p in prompts] == [128, 128, 44]
    expected, count = _transformers_perplexity(hf_reference, prompts)
    assert scored == count == PREFIX_TOKENS - len(prompts)
    assert ppl == pytest.approx(expected, rel=1e-3)
    # A real language model on English prose: far below the vocabulary's size (what a
    # uniform guess scores), so the numbers compared are not both degenerate.
    assert 1 < ppl < 200


def test_the_essay_is_the_one_its_readme_describes(essay_ids):
    readme = (TEXT_DIR / "README.md").read_text(encoding="utf-8")
    row = next(line for line in readme.splitlines() if line.startswith("| perplexity_essay.txt"))
    recorded = re.search(r"\b[0-9a-f]{64}\b", row).group(0)
    actual = hashlib.sha256((TEXT_DIR / "perplexity_essay.txt").read_bytes()).hexdigest()
    assert actual == recorded, "the essay changed: update its README (and old numbers lapse)"
    assert len(essay_ids) >= 4000
    # The count in the README is the one measured.
    assert f"| {len(essay_ids)} |" in row


def test_windows_and_configs(script):
    assert script.windows(list(range(10)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]
    # A lone last token has nothing to predict and is dropped.
    assert script.windows(list(range(9)), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert script.parse_config("quantization=auto, kv-cache-dtype=int8,max_model_len=512") \
        == {"quantization": "auto", "kv_cache_dtype": "int8", "max_model_len": 512}
    assert script.parse_config("enable_prefix_caching=false,quantization=none") \
        == {"enable_prefix_caching": False, "quantization": "none"}
    assert script.parse_config("") == {}
    with pytest.raises(ValueError, match="key=value"):
        script.parse_config("quantization")
