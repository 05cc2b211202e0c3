"""The int8 KV cache (`kv_cache_dtype="int8"`, stallfree/model/kv_quant.py): the rounding of
its rows, attention over it on the torch path against a float cache, the C++ write
(csrc/rope_cache.cpp) equal to the torch write to the bit, and an engine serving from it."""
from __future__ import annotations

import math

import pytest
import torch

from stallfree import LLM, SamplingParams
from stallfree.config import EngineConfig
from stallfree.model import kv_quant
from stallfree.model.attention import AttentionMetadata, paged_attention, slot_mapping
from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.layers import RotaryEmbedding, apply_rope, rope_and_cache

REASON = unavailable_reason()
needs_kernel = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")
TORCH_ATTENTION = "decode_attention=torch,prefill_attention=torch"
HEAD_DIM, BLOCK = 64, 16


def _rows(shape: tuple[int, ...], seed: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Normal values, each row at its own magnitude (1e-3 to 1e2): scales span the range."""
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-3, 2, math.prod(shape[:-1])).view(*shape[:-1], 1)
    return (torch.randn(shape, generator=gen) * spread).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_row_round_trips_within_half_a_step(dtype):
    x = _rows((48, 3, HEAD_DIM), seed=1, dtype=dtype)
    x[5, 2] = 0  # an all-zero row: scale 0, values 0
    rows = kv_quant.quantize(x)
    assert rows.dtype == torch.int8 and rows.shape == (48, 3, HEAD_DIM + kv_quant.SCALE_BYTES)
    q, s = rows[..., :HEAD_DIM], kv_quant.scales(rows)
    assert torch.equal(s, x.float().abs().amax(-1, keepdim=True) / 127)
    assert s[5, 2].item() == 0 and not q[5, 2].any()
    # Symmetric: each nonzero row's largest value is +-127, and -128 never appears.
    assert (q.abs().amax(-1) == 127).sum() == 48 * 3 - 1 and q.min() >= -127
    back = kv_quant.dequantize(rows, torch.float32)
    err = (x.float() - back).abs()
    # |x - s q| <= s / 2, give or take the float32 rounding of x / s and of s * q.
    assert (err <= s * (0.5 + 2**-20) + x.float().abs() * 2**-23).all()
    assert kv_quant.dequantize(rows, dtype).dtype == dtype


def test_rounding_is_half_to_even_on_the_scale_of_the_largest():
    x = torch.zeros(HEAD_DIM)
    x[:6] = torch.tensor([127.0, 2.5, -2.5, 1.5, 0.5, -126.5])  # s = 1: ties land exactly
    rows = kv_quant.quantize(x)
    assert rows[:6].tolist() == [127, 2, -2, 2, 0, -126]
    assert kv_quant.scales(rows).item() == 1.0


def _attention(cache_dtype: torch.dtype, k: torch.Tensor, v: torch.Tensor, q: torch.Tensor,
               seqs: list[tuple[int, int, list[int]]]) -> torch.Tensor:
    """Each sequence's cached tokens written, then attention for its new ones on the torch
    path (k, v, q per sequence over all its positions; q's rows for the new tokens only)."""
    cache = torch.zeros(2, 16, BLOCK, k[0].shape[1], kv_quant.row_width(HEAD_DIM, cache_dtype),
                        dtype=cache_dtype)
    meta = AttentionMetadata.build(seqs, BLOCK, "cpu", kernels=choose_kernels(TORCH_ATTENTION))
    for (start, _, table), ki, vi in zip(seqs, k, v):
        if start:
            slots = torch.tensor(slot_mapping([(0, start, table)], BLOCK))
            kv_quant.write(cache, slots, ki[:start], vi[:start])
    new_k = torch.cat([ki[s:] for (s, _, _), ki in zip(seqs, k)])
    new_v = torch.cat([vi[s:] for (s, _, _), vi in zip(seqs, v)])
    return paged_attention(q, new_k, new_v, cache, meta, HEAD_DIM ** -0.5)


def test_torch_attention_over_int8_is_the_float_cache_s_within_the_rounding():
    # A chunk after a cached prefix (gathered), a fresh chunk (its own keys), two decodes.
    seqs = [(20, 12, [3, 7]), (0, 9, [5]), (37, 1, [0, 1, 2]), (15, 1, [9])]
    heads, kv_heads = 4, 2
    k = [_rows((s + n, kv_heads, HEAD_DIM), seed=10 + i) for i, (s, n, _) in enumerate(seqs)]
    v = [_rows((s + n, kv_heads, HEAD_DIM), seed=20 + i) for i, (s, n, _) in enumerate(seqs)]
    k = [x / x.abs().amax(-1, keepdim=True) for x in k]  # |k| <= 1: softmax not saturated
    q = _rows((sum(n for _, n, _ in seqs), heads, HEAD_DIM), seed=3)
    q = q / q.abs().amax(-1, keepdim=True)
    exact = _attention(torch.float32, k, v, q, seqs)
    got = _attention(torch.int8, k, v, q, seqs)
    # The same float attention over the values the int8 cache holds: only summation order.
    held = _attention(torch.float32, [kv_quant.as_cached(x, torch.int8) for x in k],
                      [kv_quant.as_cached(x, torch.int8) for x in v], q, seqs)
    torch.testing.assert_close(got, held, rtol=1e-5, atol=1e-5)
    # Against exact K/V: each key's value moves by at most s_v / 2, and each score by at most
    # d = scale * sum |q| s_k / 2, so each softmax weight by a factor within e^(+-2d): the
    # output by at most max s_v / 2 + (e^(2d) - 1) * max |v - c| (c the values' midrange).
    row, bounds = 0, []
    for (_, n, _), ki, vi in zip(seqs, k, v):
        # Per query head (its KV head's keys): [H, 1] each.
        s_k, s_v = (kv_quant.scales(kv_quant.quantize(x)).amax(0)
                    .repeat_interleave(heads // kv_heads, 0) for x in (ki, vi))
        spread = ((vi.amax(0) - vi.amin(0)).amax(-1, keepdim=True) / 2
                  ).repeat_interleave(heads // kv_heads, 0)
        d = HEAD_DIM ** -0.5 * (q[row:row + n].abs() * s_k / 2).sum(-1, keepdim=True)
        bounds.append(s_v / 2 + torch.expm1(2 * d) * spread)  # [n, H, 1]
        row += n
    err = (got - exact).abs()
    assert (err <= torch.cat(bounds) + 1e-5).all()
    assert err.max() > 0  # the int8 path was taken


@needs_kernel
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim,kv_heads,group,tokens", [(32, 1, 2, 3), (64, 2, 3, 17),
                                                            (128, 3, 1, 40)])
def test_the_kernel_writes_the_torch_bytes(dtype, head_dim, kv_heads, group, tokens):
    gen = torch.Generator().manual_seed(head_dim + tokens)
    heads, num_blocks = kv_heads * group, 8
    rotary = RotaryEmbedding(head_dim, 256, 10000.0, None).to(dtype)
    cos, sin = rotary.lookup(torch.randint(0, 256, (tokens,), generator=gen), dtype)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen)
    qkv = (qkv * torch.logspace(-2, 2, tokens)[:, None]).to(dtype)
    v_from = (heads + kv_heads) * head_dim
    qkv[0, v_from:v_from + head_dim] = 0  # an all-zero v row
    qkv[1, v_from:v_from + 4] = torch.tensor([127.0, 2.5, -2.5, 0.5])  # ties, s = 1
    qkv[1, v_from + 4:v_from + head_dim] = 0
    slots = torch.randperm(num_blocks * BLOCK, generator=gen)[:tokens]
    cache = torch.zeros(2, num_blocks, BLOCK, kv_heads, head_dim + 4, dtype=torch.int8)

    fused_qkv, fused_cache = qkv.clone(), cache.clone()
    assert rope_and_cache(fused_qkv, cos, sin, fused_cache, slots, heads, kv_heads)
    # The quantization, to the bit, of what the kernel rotated (its float32 rotation may
    # differ from apply_rope's in the last bit: test_fused_ops.py).
    k = fused_qkv[:, heads * head_dim:v_from].view(tokens, kv_heads, head_dim)
    v = qkv[:, v_from:].view(tokens, kv_heads, head_dim)
    ref_cache = cache.clone()
    kv_quant.write(ref_cache, slots, k, v)
    assert torch.equal(fused_cache, ref_cache)
    if dtype == torch.bfloat16:  # the whole torch path, rotation included, to the bit
        qk = qkv[:, :v_from].view(tokens, heads + kv_heads, head_dim)
        torch_cache = cache.clone()
        kv_quant.write(torch_cache, slots, apply_rope(qk, cos, sin)[:, heads:], v)
        assert torch.equal(fused_cache, torch_cache)


def test_bad_values_are_refused():
    assert EngineConfig.from_kwargs(kv_cache_dtype="int8").cache.kv_cache_dtype == "int8"
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of auto, int8, fp8"):
        EngineConfig.from_kwargs(kv_cache_dtype="int4")
    with pytest.raises(ValueError, match="fp8 is not built"):
        EngineConfig.from_kwargs(kv_cache_dtype="fp8")
    with pytest.raises(ValueError, match="head_dim % 4"):
        kv_quant.row_width(66, torch.int8)


def test_the_serve_flag_sets_it():
    from stallfree.cli import build_parser
    from stallfree.cli.args import engine_config_from_args

    args = build_parser().parse_args(["serve", "--kv-cache-dtype", "int8"])
    assert engine_config_from_args(args).cache.kv_cache_dtype == "int8"
    assert build_parser().parse_args(["info", "--kv-cache-dtype", "int8"]).kv_cache_dtype == "int8"


@pytest.fixture(scope="module")
def int8_llm():
    """The default model in float32 over an int8 cache, attention on the torch path."""
    llm = LLM(None, dtype="float32", quantization="none", kv_cache_dtype="int8",
              kernels=TORCH_ATTENTION, kv_cache_memory=64 << 20, max_model_len=2048)
    yield llm
    llm.shutdown()


PROMPTS = ["The capital of France is", "def fibonacci(n):",
           "<|im_start|>user\nName three colours.<|im_end|>\n<|im_start|>assistant\n",
           "Water boils at a temperature of"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)


def _tokens(llm: LLM, prompts: list[str], **changes: object) -> list[list[int]]:
    if changes:
        llm.reconfigure(**changes)
    return [out.token_ids for out in llm.generate(prompts, GREEDY)]


def test_greedy_output_over_int8_matches_the_float_cache(int8_llm):
    engine = int8_llm.engine
    assert engine.info.kv_cache_dtype == "int8"
    cache = engine.executor.runner.kv_cache
    assert cache.dtype == torch.int8 and cache.shape[-1] == engine.model_config.head_dim + 4
    assert engine.config.cache.enable_prefix_caching
    try:
        reference = _tokens(int8_llm, PROMPTS, kv_cache_dtype="auto")
        assert engine.executor.runner.kv_cache.dtype == torch.float32
    finally:
        int8_llm.reconfigure(kv_cache_dtype="int8")
    got = _tokens(int8_llm, PROMPTS)
    assert got == reference
    runner = engine.executor.runner
    assert not runner.kv_cache[:, :, runner.null_block].any()  # the null block stays zeros


def test_a_prefix_cache_hit_and_any_chunking_give_the_same_tokens(int8_llm):
    engine = int8_llm.engine
    prompt = engine.tokenize(" ".join(["The library opens at nine and closes at six."] * 6))
    first = int8_llm.generate([prompt], GREEDY)[0]
    again = int8_llm.generate([prompt], GREEDY)[0]
    assert again.num_cached_tokens == (len(prompt) - 1) // BLOCK * BLOCK > 0
    try:
        chunked = _tokens(int8_llm, [prompt], token_budget=24, enable_prefix_caching=False)
    finally:
        int8_llm.reconfigure(token_budget=512, enable_prefix_caching=True)
    assert first.token_ids == again.token_ids == chunked[0]


def test_int8_holds_4d_over_d_plus_4_times_the_float32_blocks(int8_llm):
    engine, budget = int8_llm.engine, 64 << 20
    int8_blocks = engine.block_manager.num_total_blocks
    try:
        int8_llm.reconfigure(kv_cache_dtype="auto")
        float_blocks = engine.block_manager.num_total_blocks
    finally:
        int8_llm.reconfigure(kv_cache_dtype="int8")
    d = engine.model_config.head_dim
    assert int8_blocks / float_blocks == pytest.approx(4 * d / (d + 4), rel=1e-2)
    per_token = engine.model_config.num_hidden_layers * 2 * engine.model_config.num_key_value_heads
    assert int8_blocks == budget // (per_token * (d + 4) * BLOCK)


@needs_kernel
def test_the_kernels_and_the_layer_loop_give_the_torch_path_s_tokens(int8_llm):
    """The int8 rows written by the RoPE/cache kernel and read in place by the attention
    kernels, inside the C++ layer loop where it is built: the torch path's greedy tokens."""
    reference = _tokens(int8_llm, PROMPTS)
    llm = LLM(None, dtype="float32", quantization="none", kv_cache_dtype="int8",
              kv_cache_memory=64 << 20, max_model_len=2048)
    try:
        engine = llm.engine
        loop = engine.executor.model.layer_loop
        if loop is not None:  # the loop takes a decode over the int8 cache
            x = torch.zeros(1, engine.model_config.hidden_size)
            meta = AttentionMetadata.build([(0, 1, [0])], BLOCK, "cpu", kernels=loop.kernels)
            assert loop.fits(x, meta, engine.executor.runner.kv_cache)
        assert _tokens(llm, PROMPTS) == reference
    finally:
        llm.shutdown()
