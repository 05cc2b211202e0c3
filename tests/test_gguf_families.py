"""GGUF files written by llama.cpp's own converter (convert_hf_to_gguf.py) from tiny random
models of our families load and give transformers' greedy tokens: the families' GGUF names,
metadata keys and conventions (Q/K row order, Gemma's folded norm offset) are llama.cpp's.

The converter is unpacked by `make converter` (from the llama-cpp-python source release on
PyPI) into .build/llama_cpp_converter; the command the tests run is `convert_command`.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.model import load_model
from stallfree.model.loader import load_model_config
from stallfree.model.quant_load import weight_types
from tiny_models import build_tiny_model, save_tiny_model

CONVERTER = Path(__file__).resolve().parent.parent / ".build" / "llama_cpp_converter"
PROMPT = [(7 * j + 3) % 5000 + 10 for j in range(41)]
STEPS = 8
# family -> what its tiny model sets for the test. Phi-3 and Gemma 2, whose converters read
# the vocabulary only from a SentencePiece tokenizer.model, are in test_gguf_spm_families.py.
# Gemma 3's files keep neither query_pre_attn_scalar nor which layers are local: llama.cpp
# takes 1/sqrt(head_dim) and every 6th layer global, so the tiny model does too.
CASES = {"qwen3": {}, "mistral": dict(sliding_window=None),
         "gemma3": dict(query_pre_attn_scalar=16, layer_types=["sliding_attention"] * 3)}


def convert_command(model_dir: str, out: str, outtype: str = "f32") -> list[str]:
    return [sys.executable, str(CONVERTER / "convert_hf_to_gguf.py"), model_dir,
            "--outfile", out, "--outtype", outtype]


@pytest.fixture(scope="module", params=sorted(CASES))
def converted(request, tmp_path_factory):
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked in {CONVERTER} (`make converter`)")
    kind = request.param
    folder = tmp_path_factory.mktemp(kind)
    extra = CASES[kind]
    save_tiny_model(folder / "hf", kind, **extra)
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"))
    for outtype in ("f32", "q8_0"):
        done = subprocess.run(convert_command(str(folder / "hf"),
                                              str(folder / f"{outtype}.gguf"), outtype), env=env,
                              capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
    ref = build_tiny_model(kind, attn_implementation="eager", **extra)
    return kind, str(folder / "f32.gguf"), ref


def test_converted_gguf_loads_as_its_family(converted):
    kind, path, _ = converted
    config = load_model_config(path)
    assert config.architecture == ("llama" if kind == "mistral" else kind)
    assert config.qk_norm == (kind in ("qwen3", "gemma3"))
    assert (config.sliding_window is not None) == (kind == "gemma3")


def test_converted_gguf_gives_transformers_greedy_tokens(converted):
    kind, path, ref = converted
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    llm = LLM(path, dtype="float32", quantization="none", kv_cache_memory=8 << 20,
              block_size=16, max_num_batched_tokens=12)
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                ignore_eos=True))[0]
    assert out.token_ids == ids[len(PROMPT):], kind


def test_converted_q8_0_gguf_stays_quantized_and_close(converted):
    """The same model as Q8_0: its matmul weights kept quantized (the engine's default), the
    first step's top logprobs within Q8_0's rounding of the float file's."""
    kind, path, _ = converted
    q8_path = path.removesuffix("f32.gguf") + "q8_0.gguf"
    model, _ = load_model(q8_path, torch.float32, "cpu", quantization="auto")
    assert weight_types(model).get("q8_32", 0) > 0, weight_types(model)
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    tops = []
    for file in (path, q8_path):
        llm = LLM(file, dtype="float32", kv_cache_memory=8 << 20, block_size=16)
        tops.append(dict(llm.generate([PROMPT], params)[0].outputs[0].logprobs[0].top))
    for token, value in tops[0].items():
        assert abs(tops[1].get(token, -1e9) - value) < 0.1, (kind, token)
