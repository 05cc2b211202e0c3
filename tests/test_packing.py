"""Packed matmul weights read back (packing.py), and a model holding its matrices once: the
plain copy goes where the packing serves every call (linear.repack), the tied embedding
looks its rows up in the LM head's packing, and the paths that run with a kernel switched
off rebuild the plain weight exactly.
"""
from __future__ import annotations

import sys

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from stallfree.model import load_model
from stallfree.model.kernel_table import choose_kernels
from stallfree.model.kernels import unavailable_reason
from stallfree.model.layer_loop import LayerLoop
from stallfree.model.linear import (
    Linear,
    linear,
    pair_kernel_max_rows,
    pair_kernel_unavailable_reason,
    plain_weight,
)
from stallfree.model.packing import PackedWeight, gate_up_alternating
from stallfree.model.parallel import Shard
from tiny_models import save_tiny_model

REASON = unavailable_reason()
pytestmark = pytest.mark.skipif(REASON is not None, reason=f"kernels not built: {REASON}")


def _packed(weight: torch.Tensor, layout: str) -> PackedWeight:
    gated = layout.endswith("_gated")
    source = gate_up_alternating(weight) if gated else weight
    pack = (torch.ops.stallfree.f32_pack if layout.startswith("f32")
            else torch.ops.stallfree.amx_pack)
    return PackedWeight(pack(source), layout, tuple(weight.shape))


@settings(max_examples=40, deadline=None)
@given(layout=st.sampled_from(["f32", "f32_gated", "amx", "amx_gated"]),
       blocks=st.integers(1, 6), k=st.integers(1, 5), seed=st.integers(0, 2**16),
       ids=st.lists(st.integers(0, 10**6), min_size=1, max_size=9))
def test_a_packing_gives_back_every_value_and_row(layout, blocks, k, seed, ids):
    gen = torch.Generator().manual_seed(seed)
    rows = 32 * blocks if layout.endswith("_gated") else 16 * blocks
    cols = 32 * k if layout.startswith("amx") else 7 * k  # f32: any width
    dtype = torch.float32 if layout.startswith("f32") else torch.bfloat16
    weight = torch.randn(rows, cols, generator=gen).to(dtype)
    packed = _packed(weight, layout)
    assert packed.readable and packed.nbytes == weight.nbytes
    plain = packed.unpack()
    assert torch.equal(plain, weight) and plain.dtype == dtype
    # float32 comes back column-major, the loader's layout for torch's float32 matmuls.
    assert (plain.stride(0) == 1) == (dtype == torch.float32 and cols > 1)
    if not layout.endswith("_gated"):
        index = torch.tensor(ids) % rows
        assert torch.equal(packed.rows(index), weight[index])  # csrc/packed_rows.cpp
        assert torch.equal(packed.rows_by_index(index), weight[index])  # the torch path
        assert torch.equal(packed.rows(index.view(1, -1)), weight[index].unsqueeze(0))
        with pytest.raises(RuntimeError, match=f"row {rows} outside"):
            packed.rows(torch.tensor([0, rows]))


def test_rows_of_a_packing_take_any_ids_and_refuse_what_does_not_fit():
    weight = torch.randn(32, 64).to(torch.bfloat16)
    packed = _packed(weight, "amx")
    ids = torch.tensor([[3, 31], [0, 17]])
    assert torch.equal(packed.rows(ids.int()), weight[ids])  # int32 ids too
    assert torch.equal(packed.rows(ids.t()), weight[ids.t()])  # any strides
    assert packed.rows(torch.tensor([], dtype=torch.long)).shape == (0, 64)
    with pytest.raises(RuntimeError, match="row -1 outside"):
        packed.rows(torch.tensor([-1]))
    with pytest.raises(RuntimeError, match="amx layout holds bfloat16"):
        torch.ops.stallfree.packed_rows(packed.data.float(), ids, 32, 64, True)
    with pytest.raises(RuntimeError, match="packing of 32 x 32 values expected"):
        torch.ops.stallfree.packed_rows(packed.data, ids, 32, 32, True)


def test_layouts_that_cannot_be_read_back_say_so():
    opaque = PackedWeight(torch.zeros(4), "onednn", (2, 2))
    assert not opaque.readable
    with pytest.raises(ValueError, match="onednn packing cannot be read back"):
        opaque.unpack()
    with pytest.raises(ValueError, match="gated"):
        _packed(torch.randn(32, 8), "f32_gated").rows(torch.tensor([0]))
    with pytest.raises(ValueError, match="needs its packing"):
        plain_weight(None, None)


def test_a_layer_drops_its_plain_weight_and_gets_it_back_when_its_kernel_is_off():
    layer = Linear(40, 48, bias=True)
    weight = layer.weight.detach().clone()
    layer.prepack()
    assert layer.weight is None and layer.packed.layout == "f32"
    assert [name for name, _ in layer.named_parameters()] == ["bias"]
    x = torch.randn(5, 40)
    expected = F.linear(x, weight, layer.bias)
    torch.testing.assert_close(layer(x), expected)
    no_kernel = choose_kernels({"matmul_f32": "torch"})
    # Read back for torch, per call.
    torch.testing.assert_close(linear(x, layer.weight, layer.bias, layer.packed, no_kernel),
                               expected)
    layer.prepack(no_kernel)  # a repack without the kernel: the plain weight is kept
    assert layer.packed is None and torch.equal(layer.weight, weight)
    layer.prepack()
    assert layer.weight is None and torch.equal(layer.packed.unpack(), weight)


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory) -> str:
    return save_tiny_model(tmp_path_factory.mktemp("tied"), tie_word_embeddings=True)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tied", [True, False])
def test_a_loaded_model_holds_each_matrix_once(tied, dtype, tied_model, tiny_model):
    """In float32, and in bf16 where the tile packing's kernel takes every row count (in
    vectors); the reference is loaded with that kernel off, its plain weights kept."""
    op = "matmul_f32" if dtype == torch.float32 else "matmul_bf16"
    if dtype == torch.bfloat16 and pair_kernel_unavailable_reason() is not None:
        pytest.skip(f"bf16 matmul packing: {pair_kernel_unavailable_reason()}")
    if dtype == torch.bfloat16 and pair_kernel_max_rows() != sys.maxsize:
        pytest.skip("AMX tiles: matmuls past AMX_MAX_ROWS rows read the plain weight")
    path = tied_model if tied else tiny_model
    model, config = load_model(path, dtype, "cpu")
    reference, _ = load_model(path, dtype, "cpu", kernels={op: "torch"})
    # Plain matrices left: an untied embedding's table (a lookup, no matmul), else none.
    plain = [name for name, p in model.named_parameters() if p.dim() == 2]
    assert plain == ([] if tied else ["model.embed_tokens.weight"])
    assert model.weight_numels() == {n: p.numel() for n, p in reference.named_parameters()}
    weights = dict(model.named_weights())  # what a checkpoint writer reads: every value back
    assert weights.keys() == dict(reference.named_parameters()).keys()
    assert all(torch.equal(weights[n], p) for n, p in reference.named_parameters())
    held = (sum(p.nbytes for p in model.parameters())
            + sum(m.packed.nbytes for m in model.modules()
                  if getattr(m, "packed", None) is not None and m.weight is None))
    assert held == sum(model.weight_numels().values()) * dtype.itemsize
    # The packings alone feed the C++ layer loop (this model's 16-dim heads keep it off:
    # RoPE's kernel takes multiples of 32, so the table is asked without the shape).
    assert LayerLoop.build(model.model.layers, Shard(), choose_kernels(dtype=dtype))[1] is None
    ids = torch.tensor([0, 5, config.vocab_size - 1, 77, 5])
    embed = model.model.embed_tokens
    assert (embed.packed is not None) == tied
    assert torch.equal(embed(ids), reference.model.embed_tokens(ids))
    hidden = torch.randn(3, config.hidden_size, dtype=dtype)
    torch.testing.assert_close(model.compute_logits(hidden), reference.compute_logits(hidden),
                               rtol=1e-5 if dtype == torch.float32 else 2e-2, atol=1e-5)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_tied_embedding_is_packed_only_on_the_stage_that_computes_logits(stage, tied_model):
    """Two pipeline stages of a tied model: the first only looks the embedding up (a plain
    table), the last computes logits from it (its packing, rows looked up there)."""
    model, _ = load_model(tied_model, torch.float32, "cpu", Shard(pp_rank=stage, pp_size=2))
    embed = model.model.embed_tokens
    last = stage == 1
    assert model.logits_from_embedding == last
    assert (model.logits_packed is not None) == last and (embed.packed is not None) == last
    assert (embed.weight is None) == last
    held = model.held_bytes()
    assert held["plain beside packings"] == 0
    assert held["other"] == sum(p.nbytes for p in model.parameters())
