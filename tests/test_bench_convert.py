"""`stallfree convert --to-hf`: the default GGUF as a Hugging Face folder, same logits."""
from __future__ import annotations

import json
import shutil

import pytest
import torch

from stallfree.cli import main
from stallfree.model import AttentionMetadata, allocate_kv_cache, load_model, load_tokenizer

IDS = list(range(1000, 1037))


def _our_logits(path):
    model, config = load_model(path, torch.float32, "cpu")
    kv = allocate_kv_cache(config, 8, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([(0, len(IDS), [3, 1, 4, 0])], 16, "cpu")
    with torch.inference_mode():
        hidden = model(torch.tensor(IDS), torch.arange(len(IDS)), meta, kv)
        return model.compute_logits(hidden)


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("hf") / "smollm2"
    assert main(["convert", "--to-hf", str(out)]) == 0
    yield out
    shutil.rmtree(out, ignore_errors=True)  # 538 MB of float32 weights


@pytest.fixture(scope="module")
def dir_logits(hf_dir):
    return _our_logits(str(hf_dir))


def test_convert_round_trip_gives_the_same_logits(hf_dir, dir_logits):
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in hf_dir.iterdir()}
    assert torch.equal(_our_logits(None), dir_logits)


def test_transformers_loads_the_converted_dir(hf_dir, dir_logits):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = model(torch.tensor([IDS])).logits[0]
    ours = dir_logits
    assert ((theirs - ours).abs().max() / ours.abs().max()).item() < 1e-4
    text = "Hello there, how are you?"
    assert AutoTokenizer.from_pretrained(hf_dir)(text)["input_ids"] == \
        load_tokenizer(None)(text)["input_ids"]
    config = json.loads((hf_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and config["tie_word_embeddings"]


def test_convert_refuses_a_non_empty_dir(hf_dir, capsys):
    assert main(["convert", "--to-hf", str(hf_dir)]) == 2
    assert "not empty" in capsys.readouterr().err
