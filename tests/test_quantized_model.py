"""The default model served with its GGUF weights kept quantized (quantization="auto"), a
float checkpoint quantized to int8 at load, and quantization="none".

The quantized kernels quantize the activations too (tests/test_quant_linear.py bounds one
matmul), so the quantized model's logits differ from the same weights' float product by
more than float rounding: held here within measured bounds against the same loaded model
with its matmuls on the torch path (the rows dequantized per call: the exact weights), which
itself equals the model loaded dequantized (default_llm) to float rounding. What must hold
exactly holds exactly: the C++ layer loop against the Python one, a prompt chunked against
whole.
"""
from __future__ import annotations

import pytest
import torch

from kernel_paths import engine_kernels
from stallfree import LLM, SamplingParams
from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.linear import Linear
from stallfree.model.quant_formats import FORMATS

REASON = unavailable_reason()
# Without the kernel library, quantization="auto" dequantizes at load and "int8" is refused
# (quant_load.py).
needs_kernels = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n    ",
           "Once upon a time, in a small village by the sea, there lived an old fisherman who",
           "Photosynthesis is the process by which plants",
           "A recipe for bread: mix four cups of flour, a spoon of salt, a packet of yeast and "
           "two cups of warm water, then knead the dough for ten minutes until it is smooth."]


def linears(llm: LLM) -> list[Linear]:
    found = [m for m in llm.engine.executor.model.modules() if isinstance(m, Linear)]
    assert found
    return found


@pytest.fixture(scope="module")
def llm(quantized_llm):
    """quantized_llm without the prefix cache: KV a prompt left there on one kernel path
    would serve the next path's run of the same prompt."""
    config = quantized_llm.engine.config
    budget, caching = config.scheduler.token_budget, config.cache.enable_prefix_caching
    memory = config.cache.kv_cache_memory
    quantized_llm.reconfigure(enable_prefix_caching=False, kv_cache_memory=1 << 26)
    yield quantized_llm
    quantized_llm.reconfigure(token_budget=budget, enable_prefix_caching=caching,
                              kv_cache_memory=memory)


@pytest.fixture(scope="module")
def prompt_ids(llm) -> list[list[int]]:
    return [llm.engine.tokenize(p) for p in PROMPTS]


@needs_kernels
def test_the_matmul_weights_stay_quantized(llm, default_llm):
    model, floats = llm.engine.executor.model, default_llm.engine.executor.model
    # Q4_1 at 6 bits per weight (q4_32) and the Q8_0 embedding at 9 (q8_32), against
    # float32's 32: measured 0.207.
    assert model.held_bytes()["packings"] < 0.25 * floats.held_bytes()["packings"]
    for module in linears(llm):
        assert module.weight is None and module.packed.quant is FORMATS["q4_32"]
    assert model.logits_packed.layout == "q8_32"
    assert model.model.embed_tokens.weight is None  # its lookups read the LM head's rows
    assert model.kernels.matmul_quant.impl == "kernel"
    if choose_kernels(dtype=torch.float32).layer_loop.impl == "cpp":
        assert model.layer_loop is not None, model.layer_loop_reason


def test_quantization_none_keeps_no_quantized_matrix(default_llm):
    model = default_llm.engine.executor.model
    for module in linears(default_llm):
        assert module.packed is None or module.packed.quant is None, module.packed.layout
    assert model.logits_packed is None or model.logits_packed.quant is None
    if model.kernels.matmul_f32.kernel:
        assert {m.packed.layout for m in linears(default_llm)} == {"f32", "f32_gated"}


def _chosen_logprobs(output) -> torch.Tensor:
    return torch.tensor([e.logprob for e in output.prompt_logprobs[1:]], dtype=torch.float64)


@needs_kernels
def test_logits_near_the_dequantized_weights(llm, default_llm, prompt_ids):
    # One token: each step on the torch path dequantizes every weight again (seconds).
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0)
    quantized = llm.generate(prompt_ids, params)
    with engine_kernels(llm, {"matmul_quant": "torch"}):
        assert not llm.engine.executor.model.kernels.matmul_quant.kernel
        exact = llm.generate(prompt_ids, params)
    dequantized = default_llm.generate(prompt_ids, SamplingParams(max_tokens=0,
                                                                  prompt_logprobs=0))
    diffs = []
    for q, e, d in zip(quantized, exact, dequantized):
        # The torch path is the model loaded dequantized, to float rounding (measured 3e-5).
        assert float((_chosen_logprobs(e) - _chosen_logprobs(d)).abs().max()) < 1e-4
        diffs.append(_chosen_logprobs(q) - _chosen_logprobs(e))
        # Measured over 8 greedy steps: the tokens agree for 5, 6, 8, 7 and 8 steps.
        assert q.token_ids == e.token_ids
    # Measured over the prompts' 74 positions: mean 0.15, max 0.57 (nats); bounds ~4x.
    diffs = torch.cat(diffs).abs()
    assert float(diffs.mean()) < 0.6 and float(diffs.max()) < 2.5


@needs_kernels
def test_the_cpp_layer_loop_gives_the_python_loops_bits(llm, prompt_ids):
    if llm.engine.executor.model.layer_loop is None:
        pytest.skip(f"no C++ layer loop here: {llm.engine.executor.model.layer_loop_reason}")
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=2)
    looped = llm.generate(prompt_ids, params)
    with engine_kernels(llm, {"layer_loop": "python"}):
        assert llm.engine.executor.model.layer_loop is None
        python = llm.generate(prompt_ids, params)
    assert [o.token_ids for o in looped] == [o.token_ids for o in python]
    assert [o.outputs[0].logprobs for o in looped] == [o.outputs[0].logprobs for o in python]


@needs_kernels
def test_a_prompt_chunked_gives_its_unchunked_tokens(llm, prompt_ids):
    """Each prompt (5 to 40 tokens) alone, whole in one step and in chunks of 8 tokens.
    Measured: the same bits in every logprob too, at chunks of 16 as well. Chunks of 4 leave
    the 5-token prompt a last chunk of one token, which attends as a decode
    (attention_plan.attends_as_decode): 5e-6 apart in float32 (default_llm), made 0.25 nats
    here by the activations' int8 rounding, and a different greedy token within 6 steps."""
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    runs = {}
    for budget in (512, 8):
        llm.reconfigure(token_budget=budget)
        runs[budget] = [llm.generate([ids], params)[0].token_ids for ids in prompt_ids]
    llm.reconfigure(token_budget=512)
    assert runs[8] == runs[512]


@pytest.fixture(scope="module")
def tiny_pair(tiny_model):
    """The tiny model int8 and in float32 (untied: its LM head is a Linear of its own)."""
    pair = [LLM(tiny_model, dtype="float32", quantization=q, max_model_len=256,
                kv_cache_memory=1 << 24) for q in ("int8", "none")]
    yield pair
    for llm in pair:
        llm.shutdown()


@needs_kernels
def test_int8_quantizes_every_matmul_of_a_float_checkpoint(tiny_pair):
    quantized, floats = tiny_pair
    for module in linears(quantized):
        assert module.weight is None and module.packed.layout == "q8_32"
    for module in linears(floats):
        assert module.packed is None or module.packed.quant is None
    held = [llm.engine.executor.model.held_bytes()["packings"] for llm in tiny_pair]
    assert held[0] < 0.3 * held[1]  # 9 bits per weight against 32: 0.28
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, prompt_logprobs=0,
                            logprobs=2)
    ids = [[100 + (7 * i + 13 * j) % 5000 for j in range(8 + 4 * i)] for i in range(6)]
    decided = 0
    diffs = []
    for q, f in zip(*(llm.generate(ids, params) for llm in tiny_pair)):
        diffs.append(_chosen_logprobs(q) - _chosen_logprobs(f))
        (_, best), (_, second) = f.outputs[0].logprobs[0].top
        # Random weights leave close calls (measured margins 0.02-0.53 nats, one over 0.3):
        # the first token must agree where the float model's margin is over 3x the
        # largest logprob shift measured (0.08).
        if best - second > 0.3:
            decided += 1
            assert q.token_ids == f.token_ids
    assert decided >= 1
    diffs = torch.cat(diffs).abs()
    # Measured over the prompts' positions: mean 0.018, max 0.08 (nats); bounds ~4x.
    assert float(diffs.mean()) < 0.08 and float(diffs.max()) < 0.3


def test_an_unknown_quantization_is_refused_before_loading():
    with pytest.raises(ValueError, match="quantization must be one of auto, none, int8"):
        LLM(quantization="fp4")


@needs_kernels
def test_a_gate_not_in_whole_panels_runs_unfused(tmp_path):
    """An intermediate size that is no multiple of 8 puts the up rows inside a panel of 8:
    the gate/up matmul then runs unfused and the layers in Python, near the reference (the
    weights dequantized; the difference is x's int8 rounding)."""
    from stallfree.model.layer_loop import LayerLoop
    from stallfree.model.linear import gated_linear
    from stallfree.model.loader import load_model
    from stallfree.model.parallel import Shard
    from tiny_models import save_tiny_model

    path = save_tiny_model(tmp_path, intermediate_size=100)
    model, _ = load_model(path, torch.float32, "cpu", quantization="int8")
    loop_table = choose_kernels(dtype=torch.float32, quantized=True)  # one that runs the loop
    assert LayerLoop.build(model.model.layers, Shard(), loop_table)[1] == \
        "gate_up_proj is quantized with its up rows inside a panel of 8"
    packed = model.model.layers[0].mlp.gate_up_proj.packed
    x = torch.randn(3, model.config.hidden_size)
    ours = gated_linear(x, None, packed, model.kernels)
    reference = gated_linear(x, None, packed, choose_kernels({"matmul_quant": "torch"}))
    assert ours.shape == reference.shape == (3, 100)
    assert (ours - reference).abs().max() <= 0.05 * reference.abs().max() + 1e-4


def test_describe_names_float_weights_held_in_packings(default_llm):
    from stallfree.model.quant_load import describe

    assert describe(default_llm.engine.executor.model).startswith("float32 x")
