"""The decoder layers in one C++ call (stallfree/model/layer_loop.py) against the Python
layer loop, the reference: the same kernels in the same order, so the same bits, in the
hidden states and in every KV slot written.

In bf16 the loop needs the weights packed for the tile kernel (AMX or AVX512_BF16); on a
CPU without either those tests skip and say which flag is missing. In float32 it needs the
kernels built (f32_linear.cpp, and paged_prefill_f32.h for the chunks).
The reasons the loop gives for not running are tested everywhere.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_paths import engine_kernels
from stallfree import LLM, SamplingParams
from stallfree.kernel_ops import reference
from stallfree.model import AttentionMetadata, allocate_kv_cache, kv_quant, load_model
from stallfree.model.attention import GatherWorkspace
from stallfree.model.config import ModelConfig
from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.layer_loop import LayerLoop
from stallfree.model.layer_steps import Op, layer_steps, model_native_reason
from stallfree.model.linear import pair_kernel_unavailable_reason
from stallfree.model.parallel import Shard

MISSING = pair_kernel_unavailable_reason()
needs_loop = pytest.mark.skipif(MISSING is not None,
                                reason=f"the layer loop needs the packed bf16 kernel: {MISSING}")
F32_MISSING = unavailable_reason()
needs_f32_loop = pytest.mark.skipif(F32_MISSING is not None,
                                    reason=f"the float32 layer loop needs the kernels: "
                                           f"{F32_MISSING}")
BLOCK_SIZE, NUM_BLOCKS = 16, 600  # more than the largest drawn batch's 562 blocks
# Head size 64 (RoPE's kernel takes multiples of 32), GQA groups of 2, three layers.
SHAPE = dict(hidden_size=128, intermediate_size=96, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=64,
             max_position_embeddings=1024)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> str:
    from tiny_models import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("loop_llama"), **SHAPE)


PYTHON_LOOP = {"layer_loop": "python"}


def _forward(path, seqs, seed: int, loop: bool, dtype=torch.bfloat16, cache_dtype=None,
             quantization: str = "none"):
    """(hidden states, KV cache) of one forward over `seqs` [(cached, new, table)] with a
    random cache (of `cache_dtype`, the model's by default), by the model loaded with the
    C++ loop or without; asserts it was taken."""
    model, config = _load(path, dtype, {} if loop else PYTHON_LOOP, quantization)
    assert (model.layer_loop is not None) == loop
    gen = torch.Generator().manual_seed(seed)
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, cache_dtype or dtype, "cpu")
    if kv_quant.is_quantized(kv.dtype):
        kv.copy_(kv_quant.quantize(torch.randn((*kv.shape[:-1], config.head_dim),
                                               generator=gen)))
    else:
        kv.copy_(torch.randn(kv.shape, generator=gen))
    rows = sum(n for _, n, _ in seqs)
    ids = torch.randint(0, config.vocab_size, (rows,), generator=gen)
    pos = torch.cat([torch.arange(c, c + n) for c, n, _ in seqs])
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu", GatherWorkspace())
    with torch.inference_mode():
        hidden = model(ids, pos, meta, kv)
        if loop:
            x = torch.empty(rows, config.hidden_size, dtype=dtype)
            assert model.layer_loop.fits(x, meta, kv), "the batch took the Python loop"
    return hidden, kv


def _batch(chunks: list[tuple[int, int]], decodes: list[int], seed: int):
    """Prefill chunks (cached, new) first, then decodes of the given contexts, each on
    shuffled blocks of its own."""
    free = list(range(NUM_BLOCKS))
    random.Random(seed).shuffle(free)
    seqs = []
    for cached, new in chunks + [(c - 1, 1) for c in decodes]:
        n = -(-(cached + new) // BLOCK_SIZE)
        seqs.append((cached, new, free[:n]))
        free = free[n:]
    return seqs


@needs_loop
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.tuples(st.integers(0, 400), st.integers(2, 200)), max_size=3),
       decodes=st.lists(st.integers(1, 500), max_size=5), seed=st.integers(0, 2**16))
def test_property_the_loop_equals_the_python_layers(model_dir, chunks, decodes, seed):
    """Decodes alone, chunks alone (with and without a cached prefix) and both in one batch:
    the hidden states and the KV cache agree to the bit."""
    if not chunks and not decodes:
        decodes = [1]
    seqs = _batch(chunks, decodes, seed)
    hidden, kv = _forward(model_dir, seqs, seed, loop=True)
    ref_hidden, ref_kv = _forward(model_dir, seqs, seed, loop=False)
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(kv, ref_kv)


@needs_f32_loop
@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.tuples(st.integers(0, 400), st.integers(2, 200)), max_size=3),
       decodes=st.lists(st.integers(1, 500), max_size=14), seed=st.integers(0, 2**16))
def test_property_the_float32_loop_equals_the_python_layers(model_dir, chunks, decodes, seed):
    """float32 decodes (past the matmul kernel's 12-row micro-blocks), chunks, and both in
    one batch: the same bits."""
    if not chunks and not decodes:
        decodes = [1]
    seqs = _batch(chunks, decodes, seed)
    hidden, kv = _forward(model_dir, seqs, seed, True, torch.float32)
    ref_hidden, ref_kv = _forward(model_dir, seqs, seed, False, torch.float32)
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(kv, ref_kv)


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, marks=needs_f32_loop),
                                   pytest.param(torch.bfloat16, marks=needs_loop)])
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.tuples(st.integers(0, 400), st.integers(2, 200)), max_size=2),
       decodes=st.lists(st.integers(1, 500), max_size=8), seed=st.integers(0, 2**16))
def test_property_the_loop_over_an_int8_cache_equals_the_python_layers(model_dir, dtype,
                                                                       chunks, decodes, seed):
    """Over an int8 KV cache (kv_quant.py) the loop's kernels write and read the rows as
    the Python layers' do: the same hidden states, the same quantized rows and scales."""
    if not chunks and not decodes:
        decodes = [1]
    seqs = _batch(chunks, decodes, seed)
    hidden, kv = _forward(model_dir, seqs, seed, True, dtype, torch.int8)
    ref_hidden, ref_kv = _forward(model_dir, seqs, seed, False, dtype, torch.int8)
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(kv, ref_kv)


# Families whose layers add steps to Llama's, every one of which the loop runs: a bias on
# q/k/v (qwen2); q/k norms (qwen3); norms on both outputs, a tanh-GELU MLP, soft-capped
# scores and its own attention scale (gemma2, its window as long as any position).
FAMILIES = {"qwen2": {}, "qwen3": {}, "gemma2": dict(sliding_window=1024, num_hidden_layers=2)}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory) -> dict[str, str]:
    from tiny_models import save_tiny_model

    return {kind: save_tiny_model(tmp_path_factory.mktemp(kind), kind, **{**SHAPE, **extra})
            for kind, extra in FAMILIES.items()}


@pytest.mark.parametrize("kind", list(FAMILIES))
@pytest.mark.parametrize("dtype, quantization", [
    pytest.param(torch.float32, "none", marks=needs_f32_loop),
    pytest.param(torch.bfloat16, "none", marks=needs_loop),
    pytest.param(torch.float32, "int8", marks=needs_f32_loop)])  # quantized, with a bias
@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chunks=st.lists(st.tuples(st.integers(0, 300), st.integers(2, 100)), max_size=2),
       decodes=st.lists(st.integers(1, 300), max_size=4), seed=st.integers(0, 2**16))
def test_property_the_loop_runs_other_families_layers_as_python_does(
        family_dirs, kind, dtype, quantization, chunks, decodes, seed):
    """The steps beyond Llama's (layer_steps.py) in the C++ loop: the same bits as the
    Python layers, in the hidden states and the cache."""
    if not chunks and not decodes:
        decodes = [1]
    seqs = _batch(chunks, decodes, seed)
    hidden, kv = _forward(family_dirs[kind], seqs, seed, True, dtype, None, quantization)
    ref_hidden, ref_kv = _forward(family_dirs[kind], seqs, seed, False, dtype, None,
                                  quantization)
    assert torch.equal(hidden, ref_hidden)
    assert torch.equal(kv, ref_kv)


def test_a_layer_s_steps_follow_its_description_and_say_what_the_loop_lacks():
    base = dict(architecture="test", vocab_size=64, hidden_size=32, intermediate_size=48,
                num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8)
    ops = [step.op for step in layer_steps(ModelConfig(**base), 0)]
    assert ops == [Op.ADD_NORM, Op.MATMUL, Op.ATTEND, Op.MATMUL, Op.ADD_NORM, Op.GATED,
                   Op.MATMUL]
    gemma = ModelConfig(**base, qk_norm=True, sandwich_norms=True, hidden_act="gelu_tanh",
                        attn_logit_softcap=5.0)
    steps = layer_steps(gemma, 1)
    assert [s.op for s in steps] == [Op.ADD_NORM, Op.MATMUL, Op.QK_NORM, Op.ATTEND, Op.MATMUL,
                                     Op.NORM, Op.ADD_NORM, Op.GATED, Op.MATMUL, Op.NORM]
    assert steps[3].softcap == 5.0 and steps[7].act == "gelu_tanh"
    assert model_native_reason(gemma) is None
    windowed = ModelConfig(**base, sliding_window=16, window_layers=[False, True],
                           local_rope_theta=10000.0)
    assert [s.window for s in layer_steps(windowed, 0) if s.op is Op.ATTEND] == [None]
    assert [s.rope_table for s in layer_steps(windowed, 1) if s.op is Op.ATTEND] == [1]
    assert model_native_reason(windowed) == "the test layers have a 16-token sliding window"
    moe = ModelConfig(**base, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)
    assert Op.EXPERTS in [s.op for s in layer_steps(moe, 0)]
    assert model_native_reason(moe).endswith("a mixture of experts (its routing runs in Python)")


_LOADED: dict[tuple, tuple] = {}


def _load(path: str | None, dtype: torch.dtype = torch.bfloat16,
          kernels: dict[str, str] | None = None, quantization: str = "none"):
    key = (path, dtype, tuple(sorted((kernels or {}).items())), quantization)
    if key not in _LOADED:
        _LOADED[key] = load_model(path, dtype, "cpu", kernels=kernels,
                                  quantization=quantization)
    return _LOADED[key]


@pytest.mark.parametrize("dtype", [pytest.param("bfloat16", marks=needs_loop),
                                   pytest.param("float32", marks=needs_f32_loop)])
def test_the_default_model_generates_the_same_tokens_and_logprobs_either_way(dtype):
    """End to end on the default model: decodes beside chunked prefills, greedy, no prefix
    cache (a prefix served from it is computed differently, whichever loop runs)."""
    llm = LLM(max_model_len=1024, dtype=dtype, token_budget=64,
              enable_prefix_caching=False)
    loop = llm.engine.executor.model.layer_loop
    assert loop is not None and loop.final_norm is not None  # the final norm in the call too
    prompts = [[(i * 7919 + j * 31) % 40000 + 100 for j in range(20 + 53 * i)] for i in range(5)]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=2)
    outputs = {True: [o.outputs[0] for o in llm.generate(prompts, params)]}
    with engine_kernels(llm, PYTHON_LOOP):
        outputs[False] = [o.outputs[0] for o in llm.generate(prompts, params)]
    assert [o.token_ids for o in outputs[True]] == [o.token_ids for o in outputs[False]]
    assert [o.logprobs for o in outputs[True]] == [o.logprobs for o in outputs[False]]


@needs_f32_loop
def test_layers_it_cannot_run_say_why(model_dir):
    model, _ = load_model(model_dir, torch.float32, "cpu", kernels={"matmul_f32": "torch"})
    assert model.layer_loop is None and model.kernels.layer_loop.impl == "python"
    assert model.layer_loop_reason == model.kernels.layer_loop.reason
    assert model.layer_loop_reason.endswith("not cpp: the matmuls do not run in a packed kernel")
    table = choose_kernels(dtype=torch.float32)  # one that would run the loop
    assert LayerLoop.build(model.model.layers, Shard(), table)[1] == \
        "qkv_proj is not packed for the f32 kernel (linear.pack_weight)"
    assert LayerLoop.build(model.model.layers, Shard(tp_size=2), table)[1].startswith("tensor")
    assert LayerLoop.build([], Shard(), table)[1] == "no decoder layers on this stage"
    if MISSING is None:
        table = choose_kernels(dtype=torch.bfloat16)
        layer = copy.deepcopy(_load(model_dir)[0].model.layers[0])
        assert LayerLoop.build([layer], Shard(), table)[1] is None
        norm = copy.deepcopy(layer.input_layernorm)
        assert LayerLoop.build([layer], Shard(), table, norm)[0].final_norm is norm.weight
        norm.eps *= 2  # the final norm's step carries its own eps
        assert LayerLoop.build([layer], Shard(), table, norm)[0].final_norm is norm.weight
        norm.weight = torch.nn.Parameter(norm.weight.float())  # not the loop's dtype: left out
        assert LayerLoop.build([layer], Shard(), table, norm)[0].final_norm is None
        gate_up = layer.mlp.gate_up_proj
        gate_up.bias = torch.nn.Parameter(torch.zeros(gate_up.out_features))
        assert LayerLoop.build([layer], Shard(), table)[1] == "gate_up_proj has a bias"


def _prepared(config, seqs, kernels=None):
    meta = AttentionMetadata.build(seqs, BLOCK_SIZE, "cpu", GatherWorkspace(), kernels=kernels)
    kv = allocate_kv_cache(config, NUM_BLOCKS, BLOCK_SIZE, torch.bfloat16, "cpu")
    meta.prepare(kv[0])
    return meta, kv


@needs_loop
def test_batches_a_kernel_does_not_take_run_the_python_layers(model_dir):
    """A float32 batch, a cache of other layers, a table with any of the layer's ops on its
    torch path: no loop, or `fits` says no, as the Python path would then take a torch path
    somewhere in the layer."""
    model, config = _load(model_dir)
    loop = model.layer_loop
    meta, kv = _prepared(config, _batch([], [30], 0))
    x = torch.zeros(1, config.hidden_size, dtype=torch.bfloat16)
    assert loop.fits(x, meta, kv)
    assert not loop.fits(x.float(), meta, kv)
    assert not loop.fits(x, meta, kv[1:])
    for op in ("layer_loop", "matmul_bf16", "norm", "rope_cache"):
        assert _load(model_dir, torch.bfloat16, {op: reference(op)})[0].layer_loop is None, op
    slow = _load(model_dir, torch.bfloat16, {"decode_attention": "torch"})[0].layer_loop
    assert not slow.fits(x, *_prepared(config, _batch([], [30], 0), slow.kernels))
    x = torch.zeros(41, config.hidden_size, dtype=torch.bfloat16)  # a chunk and a decode
    slow = _load(model_dir, torch.bfloat16, {"prefill_attention": "torch"})[0].layer_loop
    meta, kv = _prepared(config, _batch([(0, 40)], [30], 0), slow.kernels)
    assert not slow.fits(x, meta, kv)
    meta, kv = _prepared(config, _batch([(0, 40)], [30], 0))
    assert loop.fits(x, meta, kv)
