"""SparseMoE (stallfree/model/moe.py) against transformers' MixtralSparseMoeBlock and
Qwen3MoeSparseMoeBlock on the same random weights: outputs, routing, ties, bf16."""
from __future__ import annotations

import copy
import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from transformers import MixtralConfig, Qwen3MoeConfig
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from stallfree.model import moe as moe_module
from stallfree.model.linear import GatedLinear, Linear
from stallfree.model.moe import SparseMoE

HIDDEN = 64
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def copy_experts(moe: SparseMoE, router: torch.Tensor, gates: list[torch.Tensor],
                 ups: list[torch.Tensor], downs: list[torch.Tensor]) -> None:
    """Fill `moe` from per-expert 2-D weights, as a checkpoint stores them:
    Mixtral  block_sparse_moe.gate.weight -> router; experts.{e}.w1 / w3 / w2 = gate / up / down
    Qwen3    mlp.gate.weight -> router; experts.{e}.gate_proj / up_proj / down_proj
    Expert e's gate goes to rows [e*2I, e*2I + I) of experts_gate_up, its up to the next I
    rows, its down_proj [H, I] to rows [e*H, (e+1)*H) of experts_down."""
    i, h = moe.intermediate_size, moe.hidden_size
    with torch.no_grad():
        moe.router.weight.copy_(router)
        for e, (gate, up, down) in enumerate(zip(gates, ups, downs)):
            moe.experts_gate_up[e * 2 * i:e * 2 * i + i].copy_(gate)
            moe.experts_gate_up[e * 2 * i + i:(e + 1) * 2 * i].copy_(up)
            moe.experts_down[e * h:(e + 1) * h].copy_(down)


def from_hf(block: nn.Module, renormalize: bool, activation: str = "silu") -> SparseMoE:
    """A SparseMoE holding `block`'s weights. transformers 5 keeps the experts fused in
    memory: gate_up_proj [E, 2I, H] (each expert's gate rows, then its up rows: the
    checkpoint's w1/gate_proj and w3/up_proj concatenated) and down_proj [E, H, I]; they
    are split back into the checkpoint's per-expert tensors here, so that copy_experts is
    the mapping a loader follows."""
    ex = block.experts
    e, two_i, h = ex.gate_up_proj.shape
    i = two_i // 2
    moe = SparseMoE(h, i, e, block.gate.top_k, renormalize, activation)
    copy_experts(moe, block.gate.weight, [ex.gate_up_proj[k, :i] for k in range(e)],
                 [ex.gate_up_proj[k, i:] for k in range(e)], list(ex.down_proj))
    # The 2-D layout is the fused 3-D one flattened: the loader may copy it in one go.
    assert torch.equal(moe.experts_gate_up, ex.gate_up_proj.reshape(e * two_i, h))
    assert torch.equal(moe.experts_down, ex.down_proj.reshape(e * h, i))
    return moe.to(block.gate.weight.device, block.gate.weight.dtype)


def randomize(block: nn.Module, seed: int) -> nn.Module:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.2)
    return block.eval()


@functools.cache
def hf_block(kind: str, norm_topk_prob: bool = True, act: str = "silu",
             device: str = "cpu", top_k: int = 2) -> tuple[nn.Module, SparseMoE]:
    """(transformers' block, the SparseMoE of its weights), float32."""
    if kind == "mixtral":
        config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=32, num_local_experts=4,
                               num_experts_per_tok=top_k, hidden_act=act,
                               experts_implementation="eager")
        block, renormalize = MixtralSparseMoeBlock(config), True
    else:
        config = Qwen3MoeConfig(hidden_size=HIDDEN, moe_intermediate_size=48, num_experts=8,
                                num_experts_per_tok=top_k, norm_topk_prob=norm_topk_prob,
                                hidden_act=act, experts_implementation="eager")
        block, renormalize = Qwen3MoeSparseMoeBlock(config), norm_topk_prob
    block = randomize(block, seed=len(kind) + norm_topk_prob).to(device)
    moe = from_hf(block, renormalize, "gelu_tanh" if act == "gelu_pytorch_tanh" else act)
    return block, moe


BLOCKS = [("mixtral", True), ("qwen3", True), ("qwen3", False)]


def run_both(block: nn.Module, moe: SparseMoE,
             x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        return block(x.unsqueeze(0)).squeeze(0), moe(x)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind,norm", BLOCKS)
@pytest.mark.parametrize("tokens", [0, 1, 3, 17])
def test_matches_transformers_fp32(kind: str, norm: bool, tokens: int, device: str) -> None:
    block, moe = hf_block(kind, norm, device=device)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens)).to(device)
    want, got = run_both(block, moe, x)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        _, hf_weights, hf_experts = block.gate(x)
        weights, experts = moe.route(x)
    assert torch.equal(experts, hf_experts)
    torch.testing.assert_close(weights, hf_weights.float(), atol=1e-6, rtol=1e-6)


@settings(max_examples=20, deadline=None)
@given(tokens=st.integers(0, 40), seed=st.integers(0, 2**16), which=st.sampled_from(BLOCKS),
       top_k=st.sampled_from([1, 2, 4]))
def test_matches_transformers_any_shape(tokens: int, seed: int, which: tuple[str, bool],
                                        top_k: int) -> None:
    """Also top-1 and top-4 (Mixtral's 4 of 4; Qwen3-MoE runs top-8): with more than two
    experts a token's sum depends on the order of its adds."""
    block, moe = hf_block(*which, top_k=top_k)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)) * 3
    want, got = run_both(block, moe, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("groups", [[[0, 1, 2], [3, 4, 5], [6, 7]], [list(range(8))]])
def test_ties_pick_the_same_experts(groups: list[list[int]]) -> None:
    """Experts of a group share one router row, so they tie on every token: where a group
    of three wins, top-2 leaves one of three equal experts out; with one group (a zero
    router) all eight tie. topk must break every tie as transformers' does."""
    block = copy.deepcopy(hf_block("qwen3", False)[0])
    with torch.no_grad():
        w = block.gate.weight
        for group in groups:
            w[group] = w[group[0]].clone() if len(groups) > 1 else 0.0
    moe = from_hf(block, renormalize=False)
    x = torch.randn(9, HIDDEN, generator=torch.Generator().manual_seed(1))
    want, got = run_both(block, moe, x)
    with torch.no_grad():
        experts = moe.route(x)[1]
        assert torch.equal(experts, block.gate(x)[2])
    # The tie was real: some token's pick came from a group of more than two.
    assert any(len(g) > 2 and set(row) <= set(g) for row in experts.tolist() for g in groups)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("serial_below", [0, 10**9])
def test_either_accumulation(serial_below: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """index_add_ and the serial index_put_ small adds (moe._accumulate) give the same bits."""
    monkeypatch.setattr(moe_module, "_SERIAL_ADD_ELEMENTS", serial_below)
    block, moe = hf_block("qwen3", True)
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(5))
    want, got = run_both(block, moe, x)
    assert torch.equal(got, want)


def test_gelu_tanh() -> None:
    block, moe = hf_block("mixtral", act="gelu_pytorch_tanh")
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(2))
    want, got = run_both(block, moe, x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind,norm", BLOCKS)
def test_bf16(kind: str, norm: bool) -> None:
    block, moe = hf_block(kind, norm)
    x = torch.randn(17, HIDDEN, generator=torch.Generator().manual_seed(3))
    ref = run_both(block, moe, x)[0]
    block16 = copy.deepcopy(block).to(torch.bfloat16)
    moe16 = from_hf(block16, norm)
    want, got = run_both(block16, moe16, x.bfloat16())
    assert got.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(moe16.route(x.bfloat16())[1], block16.gate(x.bfloat16())[2])
    if kind == "mixtral":  # the same ops in the same order (transformers 5's Mixtral)
        assert torch.equal(got, want)
    # Qwen3-MoE rounds the routing weights to bf16 before the scale, SparseMoE scales in
    # float32 (as Mixtral does): a bf16 rounding apart. Against float32: bf16's rounding of
    # weights and activations.
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got.float(), ref, atol=1e-1, rtol=5e-2)


@pytest.mark.parametrize("tokens", [1, 2])
def test_decode_reads_only_active_experts(tokens: int) -> None:
    """Experts no token picked are never computed: NaN weights there leave the output be."""
    block, moe = hf_block("qwen3", True)
    moe = copy.deepcopy(moe)
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(4))
    want = run_both(block, moe, x)[0]
    i, h = moe.intermediate_size, moe.hidden_size
    with torch.no_grad():
        active = set(moe.route(x)[1].flatten().tolist())
        for e in set(range(moe.num_experts)) - active:
            moe.experts_gate_up[e * 2 * i:(e + 1) * 2 * i] = float("nan")
            moe.experts_down[e * h:(e + 1) * h] = float("nan")
        got = moe(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_rejects_unknown_activation() -> None:
    with pytest.raises(ValueError, match="activation"):
        SparseMoE(8, 4, 4, 2, True, activation="relu")


@pytest.mark.parametrize("act", ["silu", "gelu_pytorch_tanh"])
@pytest.mark.parametrize("tokens", [1, 9])
def test_split_experts_packed_for_the_kernels(act: str, tokens: int) -> None:
    """Experts split into Linears of their own and packed for the engine's kernel table
    (the model's prepack does both) give the stacked parameters' results within float32
    rounding; the stacked copies are dropped."""
    from stallfree.model.kernel_table import choose_kernels

    block, stacked = hf_block("mixtral", act=act)
    moe = copy.deepcopy(stacked)
    moe.split_experts()
    table = choose_kernels(dtype=torch.float32)
    for module in moe.modules():
        if isinstance(module, Linear):
            module.prepack(table)
    assert moe.experts_gate_up is None and moe.experts_down is None
    assert isinstance(moe.experts[0][0], GatedLinear) == (act == "silu")
    x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        torch.testing.assert_close(moe(x), stacked(x), atol=1e-5, rtol=1e-5)
