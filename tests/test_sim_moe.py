"""MoE in the simulator: active vs total parameters, experts read per batch, config keys."""
from __future__ import annotations

import dataclasses

import pytest

from stallfree.sim.cost_model import BatchShape, ProfiledCostModel
from stallfree.sim.hardware import MODELS, ModelSpec, get_gpu, kv_cache_blocks
from stallfree.sim.roofline import DTYPE_BYTES, layer_ops

A100 = get_gpu("a100")
MIXTRAL = MODELS["mixtral-8x7b"]
# mistralai/Mixtral-8x7B-v0.1's config.json (the keys the simulator reads).
MIXTRAL_CONFIG = {
    "architectures": ["MixtralForCausalLM"], "model_type": "mixtral", "hidden_size": 4096,
    "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "vocab_size": 32000, "max_position_embeddings": 32768,
    "num_local_experts": 8, "num_experts_per_tok": 2, "hidden_act": "silu",
}


def expert_bytes(model: ModelSpec, tp: int) -> float:
    """One expert's up (gate+up) and down weights on one rank."""
    return DTYPE_BYTES * 3 * model.hidden_size * model.mlp_intermediate_size / tp


def mlp_weight_bytes(model: ModelSpec, tp: int, tokens: int) -> float:
    """Weight bytes the MLP GEMMs of one layer read, activations taken out."""
    ops = layer_ops(model, tp, tokens)
    total = ops["mlp_up_proj"][1] + ops["mlp_down_proj"][1]
    rows = tokens * (model.experts_per_token if model.is_moe else 1)
    up = model.mlp_intermediate_size // tp * (2 if model.gated_mlp else 1)
    inter = model.mlp_intermediate_size // tp
    return total - DTYPE_BYTES * rows * (model.hidden_size + up + inter + model.hidden_size)


def test_mixtral_active_and_total_parameters():
    assert MIXTRAL.is_moe and not MODELS["mistral-7b"].is_moe
    assert MIXTRAL.num_params() / 1e9 == pytest.approx(46.7, abs=0.1)
    assert MIXTRAL.num_active_params() / 1e9 == pytest.approx(12.9, abs=0.1)
    # Each expert is Mistral-7B's MLP: Mixtral less its 7 unused experts is Mistral-7B
    # plus the router.
    mistral = MODELS["mistral-7b"]
    router = MIXTRAL.num_layers * MIXTRAL.hidden_size * MIXTRAL.num_experts
    assert MIXTRAL.num_params() - 7 * MIXTRAL.num_layers * expert_bytes(MIXTRAL, 1) / 2 \
        == mistral.num_params() + router
    # Memory holds every expert: weights per rank follow the total, not the active count.
    assert MIXTRAL.weight_bytes_per_rank(2, 1) == MIXTRAL.num_params() * 2 // 2


def test_dense_models_are_unchanged():
    for spec in MODELS.values():
        if spec.is_moe:
            continue
        assert spec.num_active_params() == spec.num_params()
        assert spec.experts_read(64) == 0.0
        assert "mlp_router" not in layer_ops(spec, 1, 8)
    # The dense formulas as they were: 3 h i for the SwiGLU MLP, one weight read per GEMM.
    m = MODELS["mistral-7b"]
    assert m.num_params() == pytest.approx(7.24e9, abs=0.05e9)
    flops, nbytes = layer_ops(m, 1, 16)["mlp_up_proj"]
    h, up = m.hidden_size, 2 * m.intermediate_size
    assert (flops, nbytes) == (2.0 * 16 * h * up, DTYPE_BYTES * (h * up + 16 * h + 16 * up))
    assert mlp_weight_bytes(m, 1, 1) == mlp_weight_bytes(m, 1, 512) == expert_bytes(m, 1)


def test_experts_read_under_uniform_routing():
    assert MIXTRAL.experts_read(1) == pytest.approx(2.0)  # one token: its k experts
    assert MIXTRAL.experts_read(2) == pytest.approx(8 * (1 - 0.75 ** 2))
    assert MIXTRAL.experts_read(256) == pytest.approx(8.0)  # a large batch: all E
    reads = [MIXTRAL.experts_read(t) for t in (1, 2, 4, 8, 16, 64)]
    assert reads == sorted(reads) and reads[-1] <= 8.0


def test_decode_reads_k_experts_alone_and_all_in_a_large_batch():
    tp = 2
    one = mlp_weight_bytes(MIXTRAL, tp, 1)
    many = mlp_weight_bytes(MIXTRAL, tp, 512)
    assert one == pytest.approx(2 * expert_bytes(MIXTRAL, tp))
    assert many == pytest.approx(8 * expert_bytes(MIXTRAL, tp))
    # FLOPs follow k experts per token whatever the batch.
    for tokens in (1, 512):
        flops = layer_ops(MIXTRAL, tp, tokens)["mlp_up_proj"][0]
        assert flops == 2.0 * tokens * 2 * MIXTRAL.hidden_size * 2 * 14336 / tp
    # The router scores every expert of every token, replicated on each rank.
    assert layer_ops(MIXTRAL, tp, 4)["mlp_router"][0] == 2.0 * 4 * 4096 * 8


def test_cost_model_uses_the_roofline_for_moe_and_says_so():
    cost = ProfiledCostModel(MIXTRAL, A100, tp=2)
    assert cost.sources["linear"].startswith("roofline") and "MoE" in cost.sources["linear"]
    assert cost.sources["attention"].endswith("for head counts)")  # attention: as dense
    # A decode step reading 2 experts costs less than one reading all 8, and attention and
    # the KV cache are Mistral-7B's (same attention shapes).
    one, many = (cost.iteration(BatchShape.decode(b, 1024)).stage for b in (1, 64))
    assert one < many
    dense = dataclasses.replace(MIXTRAL, num_experts=0, experts_per_token=0)
    assert cost._attention(BatchShape.decode(8, 1024)) == \
        ProfiledCostModel(dense, A100, tp=2)._attention(BatchShape.decode(8, 1024))
    assert MIXTRAL.kv_bytes_per_token(2, 1) == MODELS["mistral-7b"].kv_bytes_per_token(2, 1)
    assert kv_cache_blocks(MIXTRAL, A100, 2, 1, 16) > 0
    with pytest.raises(ValueError, match="does not fit"):
        kv_cache_blocks(MIXTRAL, A100, 1, 1, 16)  # 93 GB of weights


def test_hf_config_reads_mixtral_and_qwen3_moe_keys():
    spec = ModelSpec.from_hf_config(MIXTRAL_CONFIG, name="mixtral-8x7b")
    assert dataclasses.replace(spec, source=MIXTRAL.source) == MIXTRAL
    qwen3 = ModelSpec.from_hf_config({  # Qwen/Qwen3-30B-A3B's config.json
        "model_type": "qwen3_moe", "hidden_size": 2048, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936,
        "num_experts": 128, "num_experts_per_tok": 8, "tie_word_embeddings": False,
        "max_position_embeddings": 40960, "hidden_act": "silu"})
    assert (qwen3.num_experts, qwen3.experts_per_token, qwen3.mlp_intermediate_size) \
        == (128, 8, 768)
    assert qwen3.num_params() / 1e9 == pytest.approx(30.5, abs=0.2)  # "30B-A3B"
    assert qwen3.num_active_params() / 1e9 == pytest.approx(3.3, abs=0.1)
    dense = ModelSpec.from_hf_config({k: v for k, v in MIXTRAL_CONFIG.items()
                                      if k not in ("num_local_experts", "num_experts_per_tok")})
    assert not dense.is_moe and dense.num_params() == MODELS["mistral-7b"].num_params()
