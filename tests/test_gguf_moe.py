"""Mixtral and Qwen3-MoE GGUF files written by llama.cpp's own converter load: Mixtral as
the "llama" architecture with experts, Qwen3-MoE as "qwen3moe", their 3-D expert tensors cut
into each expert's matrices. Float32 files give transformers' greedy tokens; a q8_0 file
keeps its attention quantized (quantization="auto"), its experts dequantized, and gives the
float file's logprobs closely.

Converted as tests/test_gguf_families.py does (`make converter`).
"""
from __future__ import annotations

import os
import subprocess

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.model.gguf import gguf_tensors
from stallfree.model.gguf_index import read_gguf
from stallfree.model.kernels import unavailable_reason
from stallfree.model.linear import Linear
from stallfree.model.loader import load_model_config
from test_gguf_families import CONVERTER, PROMPT, STEPS, convert_command
from tiny_models import FAMILIES, build_tiny_model, save_tiny_model

# llama.cpp's converter refuses a Qwen3-MoE with dense MLP layers (its tensor map has no
# dense MLP for "qwen3moe"), so the tiny model's mlp_only_layers go.
CASES = {"mixtral": {}, "qwen3_moe": dict(mlp_only_layers=[])}
KINDS = sorted(CASES)
# (kind, outtype) of each file the tests read. Mixtral's q8_0: its expert FFN length (48)
# is no multiple of 32, so the converter writes down_exps as F16 beside Q8_0 gate/up.
FILES = [*((kind, "f32") for kind in KINDS), ("mixtral", "q8_0")]


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> dict[tuple[str, str], str]:
    """(kind, outtype) -> the path of the tiny model converted: the conversions run side by
    side, as they spend most of their time importing torch and transformers."""
    if not (CONVERTER / "convert_hf_to_gguf.py").is_file():
        pytest.skip(f"llama.cpp's converter is not unpacked in {CONVERTER} (`make converter`)")
    root = tmp_path_factory.mktemp("gguf_moe")
    for kind, extra in CASES.items():
        save_tiny_model(root / kind, kind, **extra)
    env = dict(os.environ, PYTHONPATH=str(CONVERTER / "gguf-py"))
    runs = {}
    for kind, outtype in FILES:
        out = root / f"{kind}-{outtype}.gguf"
        command = convert_command(str(root / kind), str(out), outtype)
        with open(out.with_suffix(".log"), "w") as log:  # the child keeps its own handle
            runs[kind, outtype] = out, subprocess.Popen(command, env=env, stdout=log,
                                                        stderr=subprocess.STDOUT)
    for out, proc in runs.values():
        assert proc.wait(timeout=300) == 0, out.with_suffix(".log").read_text()[-3000:]
    return {key: str(out) for key, (out, _) in runs.items()}


def _llm(path: str, quantization: str) -> LLM:
    return LLM(path, dtype="float32", quantization=quantization, kv_cache_memory=8 << 20,
               block_size=16, max_num_batched_tokens=12)


@pytest.mark.parametrize("kind", KINDS)
def test_converted_moe_gguf_config(converted: dict, kind: str) -> None:
    config = load_model_config(converted[kind, "f32"])
    tiny = FAMILIES[kind][2]  # what the tiny model sets
    assert config.architecture == kind
    assert config.num_experts == (tiny.get("num_experts") or tiny["num_local_experts"])
    assert config.num_experts_per_tok == tiny["num_experts_per_tok"]
    # Mixtral's experts are intermediate_size wide.
    assert config.moe_intermediate_size == (tiny.get("moe_intermediate_size")
                                            or tiny["intermediate_size"])
    assert config.moe_renormalize and not config.dense_layers
    assert config.qk_norm == (kind == "qwen3_moe")


@pytest.mark.parametrize("kind", KINDS)
def test_converted_moe_gguf_gives_transformers_greedy_tokens(converted: dict,
                                                             kind: str) -> None:
    path = converted[kind, "f32"]
    ref = build_tiny_model(kind, attn_implementation="eager", **CASES[kind])
    ids = list(PROMPT)
    with torch.no_grad():
        for _ in range(STEPS):
            ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
    with _llm(path, "none") as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=STEPS,
                                                    ignore_eos=True))[0]
    assert out.token_ids == ids[len(PROMPT):]


@pytest.mark.skipif(unavailable_reason() is not None,
                    reason=f"kernels not built: {unavailable_reason()}")
def test_q8_0_moe_gguf_keeps_attention_quantized(converted: dict) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, logprobs=5)
    top = []
    for outtype, quantization in (("q8_0", "auto"), ("f32", "none")):
        with _llm(converted["mixtral", outtype], quantization) as llm:
            model = llm.engine.executor.model
            if outtype == "q8_0":
                qkv = model.model.layers[0].self_attn.qkv_proj
                assert isinstance(qkv, Linear) and qkv.packed.layout == "q8_32"
                assert model.model.layers[0].mlp.experts[0][0].packed.quant is None  # float
            out = llm.generate([PROMPT], params)[0]
        top.append(torch.tensor([lp for _, lp in out.outputs[0].logprobs[0].top]))
    # The best five logprobs, in order (robust to close calls swapping tokens); measured
    # 0.04 at most.
    assert float((top[0] - top[1]).abs().max()) < 0.1


def test_expert_tensors_dequantize_an_expert_at_a_time(converted: dict,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import gguf.quants

    config, tensors = read_gguf(converted["mixtral", "q8_0"])
    whole = gguf.quants.dequantize
    calls = []
    monkeypatch.setattr(gguf.quants, "dequantize",
                        lambda data, qtype: calls.append(data.shape) or whole(data, qtype))
    experts = {name: fetch for name, fetch in gguf_tensors(tensors, config)
               if ".mlp.experts." in name}
    stacks = [t for t in tensors if t.name.endswith("_exps.weight")]
    assert {t.tensor_type.name for t in stacks} == {"Q8_0", "F16"}
    for t in stacks:
        _, layer, kind, _ = t.name.split(".")  # blk.N.ffn_{gate,up,down}_exps.weight
        stacked = whole(t.data, t.tensor_type)  # [E, rows, cols]
        for e in range(config.num_experts):
            calls.clear()
            name = f"model.layers.{layer}.mlp.experts.{e}.{kind[4:-5]}_proj.weight"
            got = experts.pop(name)(None, 0, 0)
            assert torch.equal(got, torch.from_numpy(stacked[e].astype("float32")))
            assert [len(shape) for shape in calls] == [2]  # this expert's rows only
    assert not experts
